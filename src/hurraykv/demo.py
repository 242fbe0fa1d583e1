"""``make demo``: a KV cache handed from prefill to decode, through a file and a server.

A tiny Llama (built from a ``transformers.LlamaConfig``, random weights from a fixed seed,
nothing downloaded) prefills a batch of prompts that share a prefix.  Its ``DynamicCache``
becomes a snapshot (shared prefix pages stored once), is saved to a .hrry file and loaded
back, and is pushed to and pulled from a ``hurraykv serve`` started here on loopback.  The
restored caches continue greedy decoding for 16 tokens next to the original cache; every
step's logits must be bitwise identical.  Exits non-zero if anything differs.

``python -m hurraykv.demo`` (what ``make demo`` runs) leaves the snapshot as ``demo.hrry``
in the current directory and prints the ``hurraykv`` commands to try on it; ``main()``
without a path keeps it in a temporary directory.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import units


def build_model(seed: int = 2026):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def prompts(seed: int = 7):
    """Four prompts: a shared 40-token system prompt, then questions of ragged length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 512, (40,), generator=g)
    questions = [torch.randint(3, 512, (n,), generator=g) for n in (9, 3, 17, 6)]
    seqs = [torch.cat([system, q]) for q in questions]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):  # left padding, as batched generation does
        ids[b, width - len(s):] = s
        mask[b, width - len(s):] = 1
    return ids, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def prefill(model, ids, mask):
    import torch

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=True)
    return out.logits[:, -1], out.cache


def decode(model, cache, mask, first_logits, steps: int = 16):
    """Greedy decoding; returns every step's float32 logits."""
    import torch

    logits, out = first_logits, []
    with torch.no_grad():
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            step = model(input_ids=token, attention_mask=mask,
                         position_ids=positions(mask)[:, -1:], cache=cache,
                         use_cache=True)
            logits = step.logits[:, -1]
            out.append(logits.float().numpy().copy())
    return out


# What to try on the file the demo leaves: every line is a ``hurraykv`` command line.
TRY = ("inspect {f}", "inspect --seqs {f}", "validate {f}", "inspect --map {svg} {f}")


def main(keep: str | Path | None = None) -> int:
    """Run the handoff; ``keep``: where to leave the snapshot file (default: nowhere)."""
    import torch

    # One thread and deterministic kernels: the original and the restored caches must go
    # through exactly the same arithmetic for a bitwise comparison to mean anything.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        return handoff(keep)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def handoff(keep: str | Path | None = None) -> int:
    import hurraykv as hk
    from hurraykv.adapters.transformers import from_dynamic_cache, to_dynamic_cache
    from hurraykv.net.client import KVClient
    from hurraykv.net.server import KVServer

    model = build_model()
    ids, mask = prompts()
    first, cache = prefill(model, ids, mask)
    snap = from_dynamic_cache(cache, mask, page_size=16)
    pages = sum(t.num_pages for t in snap.tensors())
    shared = sum(len(t.shared_pages) for t in snap.tensors())
    print(f"model: tiny Llama, {snap.num_layers} layers, {snap.num_kv_heads} KV heads, "
          f"head_dim {snap.head_dim}, {snap.dtype}")
    print(f"batch: {snap.num_seqs} sequences, lengths {snap.seq_lens.tolist()}, "
          f"page_size {snap.page_size}")
    pools = len(snap.tensors())  # counted per pool, as `hurraykv inspect` counts them
    print(f"snapshot: {pages // pools} pages in each of {pools} pools, {shared // pools} "
          "shared by several sequences (pages whose keys/values came out bitwise equal), "
          f"{units.size(snap.nbytes)}")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(keep) if keep is not None else Path(tmp) / "batch.hrry"
        t0 = time.perf_counter()
        hk.save_snapshot(snap, path, model="tiny-llama-demo")
        report["save"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        from_file = hk.load_snapshot(path)
        from_file.tensors()
        report["load"] = time.perf_counter() - t0
        with KVServer(listen="127.0.0.1:0").run_in_thread() as server, \
                KVClient(server.address) as client:
            t0 = time.perf_counter()
            client.push("demo/batch", snap)
            pulled = client.pull("demo/batch")
            report["push+pull"] = time.perf_counter() - t0
            print(f"server: {server.address}, pushed and pulled 'demo/batch'")
        for name, seconds in report.items():
            print(f"  {name:<9} {seconds * 1e3:7.1f} ms  {units.rate(snap.nbytes, seconds):>11}")
        reference = decode(model, cache, mask, first)
        ok = True
        for label, restored in (("file", from_file), ("network", pulled)):
            cache2, mask2 = to_dynamic_cache(restored)
            same_mask = bool((mask2 == mask).all())
            logits = decode(model, cache2, mask2, first)
            same = same_mask and all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                                     for a, b in zip(reference, logits, strict=True))
            ok &= same
            print(f"continue 16 tokens from the {label} copy: logits "
                  f"{'bitwise identical' if same else 'DIFFER'} to the original cache")
    print("demo OK" if ok else "demo FAILED")
    if keep is not None:
        print(f"\n{path}: the prefill's KV cache as a .hrry file, an xxh3-64 checksum for "
              "every page. Try:")
        for line in TRY:
            print(f"  {command()} " + line.format(f=path, svg=path.with_suffix(".svg")))
    return 0 if ok else 1


def command() -> str:
    """How to run this environment's ``hurraykv`` from here: by its name when that is the
    one on PATH, else by its path (``make demo`` runs ``.venv/bin/python`` without the
    virtualenv activated, so a bare ``hurraykv`` is not found)."""
    mine = Path(sys.executable).parent / "hurraykv"  # not resolved: a venv's python links
    found = shutil.which("hurraykv")
    if not mine.exists() or (found and Path(found).resolve() == mine.resolve()):
        return "hurraykv"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def run() -> int:
    """``make demo``: the handoff, leaving ``demo.hrry`` in the current directory."""
    return main(keep=Path("demo.hrry"))


if __name__ == "__main__":
    sys.exit(run())
