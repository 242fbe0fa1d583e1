"""Tables 7 (``--only hybrid``): the connector on hybrid models.

Hybrid models (issue 31), the tiny Gemma-2-style (sliding window 64 + global) and
Qwen3-Next-style (Gated DeltaNet + full attention) models of the engine tests, one
request at a time: bytes stored per token on disk against the model treated as full
attention; TTFT of a full hit against a cold prefill with no connector; how many
requests of 8192 tokens vLLM's KV cache holds with the connector (vLLM's own
"Maximum concurrency" line) against none and against the hybrid manager off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_bench.engines import engine
from vllm_bench.measurement import segment_bytes

HYBRID_MODELS = {
    # name: (builder, its size, dtype, prompt tokens, what a full-attention treatment is);
    # larger than the tests' models, so that a prefill costs what a load may save
    "gemma2": ("tiny_gemma2", {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 8,
                               "head_dim": 64, "window": 128}, "float32", 1024,
               "the same engine with vLLM's hybrid manager off (every layer full attention, "
               "as a connector without SupportsHMA forces)"),
    "qwen3_next": ("tiny_qwen3_next", {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4},
                   "bfloat16", 960,
                   "computed: its Gated DeltaNet layers as full attention layers of its "
                   "attention geometry (vLLM cannot run it so)"),
}


def max_concurrency(log: str) -> float | None:
    """vLLM's own figure: "Maximum concurrency for N tokens per request: X.XXx"."""
    import re

    found = re.findall(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log)
    return float(found[-1]) if found else None


def hybrid_rows(work: Path, name: str, n: int) -> tuple[list, list, tuple]:
    """One hybrid model's rows of the three tables (``hybrid``)."""
    from hurraykv.integrations import tiny_models

    builder, size, dtype, tokens, _ = HYBRID_MODELS[name]
    model = getattr(tiny_models, builder)(work / name, **size)
    rng = np.random.default_rng(31)
    prompts = [rng.integers(1, 1000, tokens).tolist() for _ in range(n)]
    block = 160 if name == "qwen3_next" else 32  # vLLM's choice for Qwen3-Next's pages

    def spec(url: str | None, chunk: int | None = None, **kw) -> dict:
        extra = {"url": url} | ({"chunk_size": chunk} if chunk else {})
        return {"model": str(model), "dtype": dtype, "prompts": prompts, "max_tokens": 1,
                "rounds": 1, "block_size": 32, "num_blocks": None, "max_model_len": 8192,
                "prefix_caching": name == "qwen3_next",
                "connector": None if url is None else {"url": url, "extra": extra}} | kw

    def ms(result: dict) -> float:
        return float(np.median(result["times"])) * 1000

    plain = engine(spec(None), work, f"{name}-plain")
    variants: list[tuple[str, int | None, dict]] = [("hybrid manager on", None, {})]
    if name == "gemma2":
        variants += [("hybrid manager on, chunks of 256", 256, {}),
                     ("treated as full attention", None,
                      {"disable_hybrid_kv_cache_manager": True})]
    rows_bytes: list[list] = []
    rows_ttft = []
    for label, chunk, kw in variants:
        store = work / f"{name}-{label.replace(' ', '_').replace(',', '')}"
        cold = engine(spec(store.as_uri(), chunk, **kw), work, f"{name}-cold")
        hit = engine(spec(store.as_uri(), chunk, **kw), work, f"{name}-hit")
        stored_tokens = cold["stats"]["chunks_saved"] * (chunk or block)
        cached = [o["num_cached_tokens"] for o in hit["outputs"]]
        same = [o["tokens"] for o in hit["outputs"]] == [o["tokens"] for o in plain["outputs"]]
        rows_ttft.append((name, label, f"{ms(plain):.1f}", f"{ms(cold):.1f}", f"{ms(hit):.1f}",
                          f"{ms(hit) / ms(plain):.2f}x", f"{int(np.median(cached))} of {tokens}",
                          "yes" if same else "NO"))
        rows_bytes.append([name, label, segment_bytes(store) / max(stored_tokens, 1)])
        if name == "qwen3_next":  # its linear-attention layers as if full attention
            snap = __import__("hurraykv").load_snapshot(sorted(store.glob("*.hrry"))[0])
            attn = sum(snap.descriptor(*k).buffers[0].byte_size for k in snap.member_keys())
            layers = size["layers"]
            rows_bytes.append([name, "treated as full attention",
                               attn / snap.total_tokens / snap.num_layers * layers])
    base = rows_bytes[-1][2]
    rows_bytes = [(r[0], r[1], f"{r[2]:,.0f}", f"{r[2] / base:.2f}x") for r in rows_bytes]
    fit = max_concurrency(plain["log"])
    with_conn = engine(spec((work / f"{name}-fit").as_uri()), work, f"{name}-fit")
    off = engine(spec(None, disable_hybrid_kv_cache_manager=True), work, f"{name}-off") \
        if name == "gemma2" else None
    row_fit = (name, f"{fit:.2f}x", f"{max_concurrency(with_conn['log']):.2f}x",
               f"{max_concurrency(off['log']):.2f}x" if off else
               "does not start (\"Failed to promote local KV cache specs\")")
    return rows_bytes, rows_ttft, row_fit


def hybrid(work: Path, quick: bool) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    """Issue 31: per hybrid model, bytes stored per token against the model treated as full
    attention, TTFT of a full hit against a cold prefill (engines without and with the
    connector), and how many requests of ``max_model_len`` tokens vLLM's KV cache holds
    (its own log line) with the connector against none and against the hybrid manager off."""
    n = 3 if quick else 8
    rows_bytes, rows_ttft, rows_fit = [], [], []
    for name in HYBRID_MODELS:
        b, t, f = hybrid_rows(work, name, n)
        rows_bytes += b
        rows_ttft += t
        rows_fit.append(f)
    return [
        (f"Bytes stored per token, file:// segments on disk over the tokens they hold ({n} "
         f"prompts of 1024 / 960 tokens, chunks of one block unless said; Gemma-2-style: 8 "
         f"layers, 4 of them a 128-token window, 8 KV heads x 64, float32; Qwen3-Next-style: "
         f"8 layers, 4 of them Gated DeltaNet, 4 KV heads x 64, bfloat16); against the model "
         f"treated as full attention: Gemma-2: {HYBRID_MODELS['gemma2'][4]}; Qwen3-Next: "
         f"{HYBRID_MODELS['qwen3_next'][4]}",
         ("model", "stored as", "bytes/token", "ratio"), rows_bytes),
        (f"TTFT (one token, one request at a time, median of {n}): no connector, the "
         f"connector's first engine (cold, stores) and a fresh engine (a full hit: every "
         f"whole chunk; Qwen3-Next's hit ends where its prefill step ended)",
         ("model", "stored as", "no connector ms", "cold ms", "hit ms", "hit / no connector",
          "cached tokens", "tokens equal"), rows_ttft),
        ("Requests of 8192 tokens vLLM's KV cache holds (1 GiB, its own log line 'Maximum "
         "concurrency'): without a connector, with this connector (hybrid manager on), and "
         "with the hybrid manager off (what a connector without SupportsHMA forces)",
         ("model", "no connector", "HurrayConnector", "hybrid manager off"), rows_fit),
    ]
