"""The ```python examples of ``docs/*.md`` run as written.

``docs/worked-example.md`` runs on its own, and prints what its comments say; its byte
table is what ``hurraykv inspect`` prints for the vector file.  ``docs/adapters.md``'s
examples are fragments of engine code: they run here with the engine's own objects
(vLLM's ``kv_caches`` and block ids, a FlashInfer page table, an SGLang pool, a
Transformers model) built to each engine's layout as the adapter tests build them, and a
stand-in for the one object only a GPU can make (FlashInfer's wrapper, which records the
calls).  ``docs/vllm.md`` is run by its own tests; ``docs/api.md`` holds signatures.  A
new ```python block in ``docs/`` fails ``test_every_python_block_in_the_docs_is_run``
until it is run here."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hurraykv as hk
from hurraykv.cli import main as hurraykv

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# vllm.md: its quickstart has a test of its own; api.md: signatures, not examples
# (generated and checked by tests/docs/test_api_reference.py)
RUN_ELSEWHERE = {"vllm.md", "api.md"}


def blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), re.S)


def block(name: str, marker: str) -> str:
    """The one block of ``docs/name`` that contains ``marker``."""
    found = [b for b in blocks(name) if marker in b]
    assert len(found) == 1, f"docs/{name}: {len(found)} blocks contain {marker!r}"
    return found[0]


def run(name: str, code: str, **given) -> dict:
    namespace = {"__name__": "__docs__", **given}
    exec(compile(code, f"docs/{name}", "exec"), namespace)
    return namespace


# Which test runs each block: (file, a text only that block contains).
RUNS = [("worked-example.md", "hk.BlockPagedTensor(pool"),
        ("adapters.md", "from hurraykv.adapters.vllm import"),
        ("adapters.md", "from hurraykv.adapters.flashinfer import"),
        ("adapters.md", "from hurraykv.adapters.sglang import"),
        ("adapters.md", "small = snap.compact()"),
        ("adapters.md", "from hurraykv.adapters.transformers import"),
        ("architecture.md", "class TestPerTensor(QuantSchemeTests)"),
        ("architecture.md", "class TestShout(ServerOperationTests)")]


def test_every_python_block_in_the_docs_is_run():
    for path in sorted(DOCS.glob("*.md")):
        if path.name in RUN_ELSEWHERE:
            continue
        for code in blocks(path.name):
            markers = [m for f, m in RUNS if f == path.name and m in code]
            assert len(markers) == 1, f"docs/{path.name}: a python block no test runs:\n{code}"


# ---- docs/worked-example.md ------------------------------------------------------------
def test_the_worked_example_builds_the_vector_and_prints_what_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = block("worked-example.md", "hk.BlockPagedTensor(pool")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        env = run("worked-example.md", code)
    vector = ROOT / "tests" / "vectors" / "worked_example_f16_key_layer3.bin"
    assert env["wire"] == vector.read_bytes()
    said = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    assert out.getvalue().splitlines() == said


def test_the_worked_example_table_is_what_inspect_prints(capsys):
    vector = ROOT / "tests" / "vectors" / "worked_example_f16_key_layer3.bin"
    assert hurraykv(["inspect", str(vector)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if re.match(r"[0-9a-f]{4}  ", line)]
    text = (DOCS / "worked-example.md").read_text()
    table = [line for line in text.splitlines() if re.match(r"[0-9a-f]{4}  ", line)]
    assert [line.rstrip() for line in table] == [line.rstrip() for line in printed]
    assert "hurraykv inspect tests/vectors/worked_example_f16_key_layer3.bin" in text


# ---- docs/adapters.md ------------------------------------------------------------------
def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_vllm_example_runs(tmp_path, monkeypatch):
    from tests.adapters.test_adapters import NB, random_caches, vllm_tables

    monkeypatch.chdir(tmp_path)
    caches = random_caches(torch.uint8, seed=21)  # vLLM holds fp8 caches as uint8
    kv_caches = {f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)}
    block_ids, seq_lens = vllm_tables(21)
    used = {int(b) for b in block_ids.flatten()}
    free = iter(b for b in range(NB) if b not in used)
    new_block_ids = [[next(free) for _ in range(-(-int(n) // caches[0].shape[2]))]
                     for n in seq_lens.tolist()]
    env = run("adapters.md", block("adapters.md", "from hurraykv.adapters.vllm import"),
              kv_caches=kv_caches, block_ids=block_ids, seq_lens=seq_lens,
              k_scales=[0.5, 0.25, 2.0], v_scales=[1.5, 3.0, 0.125],
              new_block_ids=new_block_ids)
    assert env["snap"].dtype == "float8_e4m3" and env["snap"].kv_scales.tolist()[0] == [0.5, 1.5]
    # the load wrote sequence 0's blocks into the blocks the allocator chose
    first = block_ids[0, : len(new_block_ids[0])].long()
    for cache in kv_caches.values():
        assert same_bytes(cache[new_block_ids[0]], cache[first])
    assert len(env["caches"]) == len(caches) and env["seq_lens"].tolist() == seq_lens.tolist()


class Wrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` needs CUDA: this one records."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def plan(self, *args, **kw) -> None:
        self.calls.append(("plan", args, kw))

    def run(self, *args, **kw) -> None:
        self.calls.append(("run", args, kw))


def test_the_flashinfer_example_runs():
    from tests.adapters.test_flashinfer_adapter import INDICES, INDPTR, LAST, caches

    real = caches("NHD", dtype=torch.float32, seed=22)
    ks, vs = [0.5, 2.0, 0.25], [1.5, 0.75, 4.0]
    fp8 = [torch.stack([c[:, 0] / k, c[:, 1] / v], dim=1).to(torch.float8_e4m3fn)
           for c, k, v in zip(real, ks, vs, strict=True)]
    wrapper = Wrapper()
    env = run("adapters.md", block("adapters.md", "from hurraykv.adapters.flashinfer import"),
              paged_kv_caches=fp8, kv_indptr=INDPTR, kv_indices=INDICES,
              kv_last_page_len=LAST, k_scales=ks, v_scales=vs, wrapper=wrapper,
              num_qo_heads=4, num_kv_heads=fp8[0].shape[3], head_dim=fp8[0].shape[4],
              page_size=fp8[0].shape[2], q=torch.zeros(4, 4, fp8[0].shape[4]), layer=2)
    (plan, pargs, _), (call, rargs, rkw) = wrapper.calls
    assert plan == "plan" and call == "run"
    out = env["out"]
    # HND as asked: the same pages with heads and tokens swapped
    assert same_bytes(rargs[1], fp8[2].permute(0, 1, 3, 2, 4))
    assert torch.equal(pargs[0], INDPTR) and torch.equal(pargs[1], INDICES)
    assert rkw == {"k_scale": ks[2], "v_scale": vs[2]} and out.k_scales == ks


def sglang_pools():
    from tests.adapters.test_sglang_adapter import filled

    pools, rows, lens = filled(4, dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0)
    pool = SimpleNamespace(k_buffer=pools.k_buffer, v_buffer=pools.v_buffer, page_size=4,
                           dtype=torch.float8_e4m3fn, use_hnd=False, kv_cache_layout="nhd")
    return pools, pool, rows, lens


def test_the_sglang_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pools, pool, rows, lens = sglang_pools()
    batch = SimpleNamespace(seq_lens=lens, req_pool_indices=torch.tensor(rows))
    env = run("adapters.md", block("adapters.md", "from hurraykv.adapters.sglang import"),
              token_to_kv_pool=pool,
              req_to_token_pool=SimpleNamespace(req_to_token=pools.req_to_token),
              batch=batch, k_scales=[0.5, 0.5], v_scales=[2.0, 2.0])
    out = env["out"]
    assert env["snap"].kv_scales.tolist() == [[0.5, 2.0]] * 2
    assert out.req_pool_indices.tolist() == [1, 2, 3] and not out.req_to_token[0].any()
    assert not out.k_buffers[0][:4].any()  # page 0, the padding sink, stays zero

    env = run("adapters.md", block("adapters.md", "small = snap.compact()"),
              hk=hk, from_sglang_pool=env["from_sglang_pool"], pool=pool,
              req_to_token=pools.req_to_token, seq_lens=lens,
              req_pool_indices=torch.tensor(rows))
    small = hk.load_snapshot(tmp_path / "batch.hrry")
    assert small.equal(env["small"]) and small.layer(0)[0].num_pages < pool.k_buffer[0].shape[0]


def test_the_transformers_example_runs():
    from hurraykv.demo import build_model, prompts

    torch.manual_seed(0)
    model = build_model()
    ids, mask = prompts()
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).logits[:, -1:].argmax(-1)
        env = run("adapters.md", block("adapters.md", "from hurraykv.adapters.transformers"),
                  model=model, ids=ids, mask=mask, next_ids=first,
                  extended_mask=torch.cat([mask, torch.ones_like(first)], dim=-1))
    assert torch.equal(env["mask"], mask)  # restored left-padded, with its mask
    assert env["snap"].seq_lens.tolist() == mask.sum(-1).tolist()
    assert env["next_out"].logits.shape[:2] == (ids.shape[0], 1)


# ---- docs/architecture.md --------------------------------------------------------------
def test_the_extension_contract_examples_pass_as_a_test_module(tmp_path):
    """The two examples of "Extending hurraykv" (a scheme's and an operation's test class)
    are a test module that pytest runs, every inherited test passing: ``acme_ops`` is the
    operation of ``tests/support/plugins/server_ops``, on the path as if installed."""
    code = "\n\n".join(block("architecture.md", marker) for marker in (
        "class TestPerTensor(QuantSchemeTests)", "class TestShout(ServerOperationTests)"))
    (tmp_path / "test_example.py").write_text(code)
    plugin = ROOT / "tests" / "support" / "plugins" / "server_ops"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(plugin), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "test_example.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    from hurraykv.testing import QuantSchemeTests, ServerOperationTests

    ran = sum(n.startswith("test_") for c in (QuantSchemeTests, ServerOperationTests)
              for n in dir(c))
    assert re.search(rf"\b{ran} passed\b", out.stdout), out.stdout[-2000:]


@pytest.mark.parametrize("name", sorted(p.name for p in DOCS.glob("*.md")
                                        if p.name not in RUN_ELSEWHERE))
def test_docs_python_blocks_compile(name):
    for i, code in enumerate(blocks(name)):
        compile(code, f"docs/{name} (block {i + 1})", "exec")
