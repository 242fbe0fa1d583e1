"""The mistakes people make and the gaps they hit first: every message is checked."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

import hurraykv as hk
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from hurraykv.store import PageStore
from tests.snapshots import make_snapshot

META = {"engine": "vllm", "tp": 2, "scale": 0.5, "ok": True, "layers": [1, 2]}


def with_meta() -> hk.KVCacheSnapshot:
    return make_snapshot("bfloat16").with_info("llama-3-8b", META)


# ---- model and metadata on every path ---------------------------------------------------
def test_metadata_survives_files_both_readers(tmp_path):
    s = make_snapshot("bfloat16")
    hk.save_snapshot(s, tmp_path / "m.hrry", model="llama-3-8b", metadata=META)
    for snap in (hk.load_snapshot(tmp_path / "m.hrry"),
                 hk.read_snapshot_sequential(tmp_path / "m.hrry")):
        assert (snap.model, snap.metadata) == ("llama-3-8b", META)
        assert snap.equal(s)
    f = hk.HrryFile.open(tmp_path / "m.hrry")  # mirrored for KV-only tools
    assert f.kv["hurraykv.model"] == "llama-3-8b" and f.kv["engine"] == "vllm"


def test_metadata_survives_streams():
    buf = io.BytesIO()
    hk.write_snapshot_stream(with_meta(), buf)
    buf.seek(0)
    back = hk.read_snapshot_stream(buf)
    assert (back.model, back.metadata) == ("llama-3-8b", META)


def test_metadata_survives_push_and_pull(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
        with KVClient(st.address) as c:
            c.push("k", with_meta())
            back = c.pull("k")
        assert (back.model, back.metadata) == ("llama-3-8b", META)
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st, \
            KVClient(st.address) as c:  # and through the server's own files
        back = c.pull("k")
    assert (back.model, back.metadata) == ("llama-3-8b", META)


def test_metadata_survives_the_page_store(redis_url):
    store = PageStore.from_url(redis_url)
    try:
        store.put("meta", with_meta())
        back = store.get("meta")
        assert (back.model, back.metadata) == ("llama-3-8b", META)
    finally:
        store.client.close()


def test_a_plain_snapshot_has_no_info_member():
    s = make_snapshot("float16").with_info()
    s.model = None
    assert [n for n, *_ in s.members()][:2] == ["seq_lens", "layers.0.key"]


@pytest.mark.parametrize(("metadata", "why"), [
    ({"hurraykv.x": 1}, "reserved prefix"),
    ({"blob": b"\x00"}, r"metadata\['blob'\] is a bytes"),
    ({"nested": {"a": 1}}, "lists of them"),
    ({3: "x"}, "keys are str"),
])
def test_metadata_values_every_path_can_carry(tmp_path, metadata, why):
    with pytest.raises(hk.SnapshotError, match=why):
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "x.hrry", metadata=metadata)
    assert not (tmp_path / "x.hrry").exists()


# ---- torch tensors where NumPy arrays go ------------------------------------------------
def test_torch_tensors_bfloat16_included_are_accepted():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 4, 2, 8, generator=g).bfloat16()
    t = hk.BlockPagedTensor(pool, torch.tensor([3, 1, 4]), torch.tensor([0, 2, 3]),
                            torch.tensor([7, 2]))
    assert t.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(t.gather(1).view(np.uint16),
                          pool[4, :2].view(torch.int16).numpy().view(np.uint16))
    snap = hk.KVCacheSnapshot.from_arrays([pool], [pool * 2], torch.tensor([3, 1, 4]),
                                          torch.tensor([0, 2, 3]), torch.tensor([7, 2]))
    assert np.array_equal(snap.tensor(0, "value").page_pool.astype(np.float32),
                          (pool * 2).float().numpy())
    seqs = hk.BlockPagedTensor.from_sequences([pool[0], pool[1, :3]], 4)
    assert seqs.seq_lens.tolist() == [4, 3]


def test_an_hnd_pool_is_named():
    pool = np.zeros((6, 4, 16, 8), np.float16)  # [num_pages, heads, page_size, head_dim]
    with pytest.raises(hk.LayoutError, match=r"HND order.*transpose\(0, 2, 1, 3\)"):
        hk.KVCacheSnapshot.from_arrays([pool], [pool], [0, 1, 2], [0, 3], [40], page_size=16)
    with pytest.raises(hk.LayoutError, match=r"pools are \[num_pages, page_size, num_heads, "
                                             r"head_dim\]"):
        hk.KVCacheSnapshot.from_arrays([pool], [pool], [0, 1, 2], [0, 3], [40])


# ---- imports ---------------------------------------------------------------------------
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_hurraykv_needs_neither_torch_nor_redis():
    p = _python("import sys, hurraykv as hk\n"
                "assert 'torch' not in sys.modules and 'redis' not in sys.modules\n"
                "assert hk.KVClient.__name__ == 'KVClient' and hk.PageStore\n"
                "assert 'redis' not in sys.modules\n"
                "assert issubclass(hk.RemoteError, hk.HurrayError)\n"
                "assert issubclass(hk.StoreError, hk.HurrayError)\n")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(("missing", "code", "extra"), [
    ("torch", "import hurraykv.adapters.vllm", "adapters"),
    ("redis", "from hurraykv.store import PageStore; PageStore.from_url('redis://x:1')",
     "redis"),
])
def test_a_missing_optional_package_names_the_extra(missing, code, extra):
    p = _python(f"import sys; sys.modules[{missing!r}] = None\n"
                "import hurraykv as hk\n"
                f"try:\n    {code}\n"
                "except hk.MissingDependencyError as e:\n"
                "    assert isinstance(e, ImportError); print(e)\n")
    assert p.returncode == 0, p.stderr
    assert f"pip install 'hurraykv[{extra}]'" in p.stdout and missing in p.stdout


# ---- files that are not what was expected -----------------------------------------------
def _safetensors(path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))


def _zip(path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data.pkl", b"x")


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: np.save(p, np.zeros(3)), "a NumPy .npy file"),
    (_safetensors, "a safetensors file"),
    (lambda p: p.write_bytes(b""), "an empty file"),
    (lambda p: _zip(p), "a zip archive"),
])
def test_not_a_hurray_file_says_what_it_looks_like(tmp_path, make, what):
    path = tmp_path / "input"
    make(path)
    if not path.exists():  # np.save appends .npy
        path = tmp_path / "input.npy"
    with pytest.raises(hk.ContainerError, match=f"this is {what}.*, not a .hrry file"):
        hk.load_snapshot(path)
    if path.stat().st_size:
        with pytest.raises(hk.StreamError, match=f"this is {what}.*, not a Hurray stream"):
            hk.read_snapshot_stream(io.BytesIO(path.read_bytes()))


def test_a_stream_and_a_file_are_told_apart(tmp_path):
    s = make_snapshot("float16")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    buf = io.BytesIO()
    hk.write_snapshot_stream(s, buf)
    (tmp_path / "s.stream").write_bytes(buf.getvalue())
    with pytest.raises(hk.ContainerError, match=r"this is a Hurray stream .* not a .hrry "
                                                r"file .*read_snapshot_stream"):
        hk.load_snapshot(tmp_path / "s.stream")
    with pytest.raises(hk.StreamError, match=r"this is a .hrry file, not a Hurray stream .*"
                                             r"load_snapshot"):
        hk.read_snapshot_stream(io.BytesIO((tmp_path / "s.hrry").read_bytes()))
