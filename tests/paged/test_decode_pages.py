"""``BlockPagedTensor.decode_pages``: physical pages of any pool as values of a chosen
dtype, by the spec formula ``x = scale * (q - zero_point)`` (fp8: ``code * fp8_scale``),
compiled where a scheme's granularity has a plan (``quant.KERNEL_PLANS``) and NumPy
elsewhere, checked here against the formula written out from the stored bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import hurraykv as hk
from hurraykv import kernels
from hurraykv.wire.dtypes import unpack

PLUGINS = Path(__file__).resolve().parents[1] / "support" / "plugins"


def spec_values(t: hk.BlockPagedTensor) -> np.ndarray:
    """float32 ``[num_pages, page_size, H, D]`` of the pool by the spec's formula, from the
    stored codes and parameter bytes (no hurraykv dequantizing code involved)."""
    et = t.element_type
    n = t.num_pages * t.page_size * t.num_heads * t.head_dim
    codes = (unpack(t.pool_rows, et, n) if et.sub_byte else t.pool_rows).reshape(
        t.num_pages * t.page_size, t.num_heads, t.head_dim).astype(np.float64)
    q = t.quantization
    if q is None:
        scale = 1.0 if t.fp8_scale is None else t.fp8_scale
        return (codes * scale).astype(np.float32).reshape(t.page_pool.shape)
    if q.GRANULARITY == "tensor":
        scale, zero = np.float64(q.scale), np.float64(q.zero_point)
    else:
        count = t.param_count()
        scales = t.quant_params[q.scale_buffer - 3][:4 * count].view("<f4").astype(np.float64)
        zps = np.zeros(count) if q.zero_point_buffer is None else \
            t.quant_params[q.zero_point_buffer - 3][:4 * count].view("<i4").astype(np.float64)
        shape = [-1, 1, 1] if q.per_slot else [1, 1, 1]
        if not q.per_slot:
            shape[q.axis] = -1
        scale, zero = scales.reshape(shape), zps.reshape(shape)
    return ((codes - zero) * scale).astype(np.float32).reshape(t.page_pool.shape)


def pool(pages: int = 5, size: int = 4, heads: int = 2, dim: int = 16) -> hk.BlockPagedTensor:
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((pages, size, heads, dim)) * 4).astype(np.float32)
    values[..., 3] *= 25  # an outlier channel
    values[1, 2] = 0  # a zero slot
    table = rng.permutation(pages)[:pages - 1]  # an unreferenced page: decoded all the same
    return hk.BlockPagedTensor(values, table, [0, 2, len(table)], [2 * size - 1, 2 * size])


FORMS = [("per_block_affine", "int8", True, None), ("per_block_affine", "int4", True, None),
         ("per_block_affine", "uint8", False, None), ("per_block_affine", "uint4", False, None),
         ("per_block_affine", "int2", True, None), ("per_channel", "int8", True, 2),
         ("per_channel", "int4", True, 1), ("per_channel", "uint8", False, 2),
         ("per_tensor", "int8", True, None), ("per_tensor", "uint8", False, None)]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}-{f[1]}-axis{f[3]}")
def test_pages_decode_by_the_spec_formula_into_the_dtype(form, compiled, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", compiled)
    scheme, storage, symmetric, axis = form
    q = pool().quantize(scheme, storage, symmetric, axis=axis)
    want = spec_values(q)
    for first, count in ((0, 5), (1, 3), (4, 1), (2, 0)):
        got = q.decode_pages(first, count, dtype)
        assert got.dtype == np.dtype(dtype) and got.shape == (count, 4, 2, 16)
        # float32 values exactly; a narrower dtype as NumPy converts them (nearest even)
        assert got.tobytes() == want[first:first + count].astype(dtype).tobytes(), \
            (first, count)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_fp8_and_float_pools_decode_too(compiled, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", compiled)
    t = pool()
    codes = (t.page_pool / 8).astype(ml_dtypes.float8_e4m3fn)
    f8 = hk.BlockPagedTensor(codes, t.block_table, t.seq_ptr, t.seq_lens,
                             element_type="float8_e4m3", fp8_scale=8.0)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        assert f8.decode_pages(1, 3, dtype).tobytes() == spec_values(f8)[1:4].astype(
            dtype).tobytes()
    bf = hk.BlockPagedTensor(t.page_pool.astype(ml_dtypes.bfloat16), t.block_table,
                             t.seq_ptr, t.seq_lens)
    assert np.array_equal(bf.decode_pages(0, 5), t.page_pool.astype(
        ml_dtypes.bfloat16).astype(np.float32))


def test_a_reused_buffer_holds_the_result_and_a_read_only_pool_decodes():
    q = pool().quantize("per_block_affine", "int8")
    frozen = q.derive(np.frombuffer(q.pool_rows.tobytes(), q.pool_rows.dtype).reshape(
        q.pool_rows.shape))
    assert not frozen.pool_rows.flags.writeable
    scratch = np.zeros(5 * 4 * 2 * 16 * 4 + 7, np.uint8)
    first = frozen.decode_pages(0, 5, np.float32, scratch)
    assert np.shares_memory(first, scratch) and np.array_equal(first, spec_values(q))
    second = frozen.decode_pages(2, 1, ml_dtypes.bfloat16, scratch)
    assert np.shares_memory(second, first)  # overwritten by the next decode


def test_a_bad_range_or_buffer_is_refused_naming_it():
    q = pool().quantize("per_channel", "int8", axis=2)
    with pytest.raises(hk.LayoutError, match=r"first.*found 4.*count 2.*\[0, 5\)"):
        q.decode_pages(4, 2)
    with pytest.raises(hk.LayoutError, match=r"first.*found -1"):
        q.decode_pages(-1, 1)
    with pytest.raises(hk.LayoutError, match=r"out.*found 100.*at least 512 bytes"):
        q.decode_pages(0, 1, np.float32, np.zeros(100, np.uint8))


def test_dequantize_and_quantize_from_fp8_use_the_same_values():
    t = pool()
    for q in (t.quantize("per_block_affine", "uint4", False),
              t.quantize("per_tensor", "int8")):
        assert np.array_equal(q.dequantize().page_pool, spec_values(q))


def test_a_scheme_from_outside_the_package_is_quantized_decoded_and_stored():
    """A scheme registered through the entry point group ``hurraykv.quant_schemes`` of a
    distribution on the path (tests/support/plugins/quant_scheme: a class, not an edit of
    the package) quantizes, decodes compiled, round-trips a file, and is offered by the
    vLLM connector's configuration; a plugin that cannot be imported is skipped with a
    warning naming it, the built-ins standing."""
    script = textwrap.dedent("""\
        import warnings, tempfile, os
        import numpy as np
        import hurraykv as hk
        from hurraykv.integrations.vllm import store_format as sf
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            names = sf.scheme_names()
        print("warned", [str(w.message) for w in said])
        print("names", names)
        x = np.random.default_rng(0).standard_normal((4, 4, 2, 8)).astype(np.float32)
        t = hk.BlockPagedTensor(x, np.arange(4), [0, 4], [16])
        toy, ref = t.quantize("toy_per_slot", "int8"), t.quantize("per_block_affine", "int8")
        print("tag", hex(toy.descriptor().quantization.TAG))
        print("same", np.array_equal(toy.decode_pages(0, 4), ref.decode_pages(0, 4)))
        fmt = sf.parse("int8:toy_per_slot", "store_dtype", None)
        snap = fmt.segment([[fmt.encode(x, "key", 0), fmt.encode(x, "value", 0)]], "m")
        path = os.path.join(tempfile.mkdtemp(), "toy.hrry")
        hk.save_snapshot(snap, path)
        back = hk.load_snapshot(path)
        print("file", type(back.tensor(0, "key").quantization).__name__,
              np.array_equal(back.tensor(0, "key").decode_pages(0, 4), toy.decode_pages(0, 4)))
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PLUGINS / "quant_scheme"), str(PLUGINS / "broken_scheme"),
         str(PLUGINS / "noreg_scheme"),
         os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "'broken'" in lines["warned"] and "no_such_module_anywhere" in lines["warned"]
    assert "broken-scheme 0.1" in lines["warned"]
    assert "'forgotten' = 'noreg_scheme' (distribution noreg-scheme 0.1) is skipped: the " \
        "module registers no scheme on import" in lines["warned"]
    assert lines["names"] == "('per_block_affine', 'per_channel', 'toy_per_slot')"
    assert lines["tag"] == "0xf3"
    assert lines["same"] == "True"
    assert lines["file"] == "ToySlotScheme True"
    plain = subprocess.run([sys.executable, "-c", "from hurraykv.integrations.vllm import "
                            "store_format as sf; print(sf.scheme_names())"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ))
    assert plain.stdout.strip() == "('per_block_affine', 'per_channel')"
