"""Tables 4 (``--only store_dtype``): store dtypes' accuracy, reconstruction error and
capacity.

Store dtypes (``store_dtype`` auto, int8, int8 per_channel, int4, fp8), on random-weight
models: the tiny Llama of table 1 (float32) and the model of table 2 (bfloat16), 200
seeded random prompts of 200 tokens each.  Per store dtype an engine stores the
prompts' KV (``kv_producer``, 1 token) and a fresh engine of the same store dtype
(``kv_consumer``) loads the stored 192-token prefixes and decodes 64 greedy tokens, all
prompts in one ``generate()`` (16 at a time, logprobs of the top 5); against an engine
without a connector: prompts whose 64 tokens are identical, the mean first divergence,
the absolute difference of the reference's first token's logprob, and the stored bytes
per token (store directory over stored tokens).  Then the relative RMS error of K and V
per layer (``store_format.reconstruction_error``) on the models' own pages, read from
stored auto segments, which is what carries over to trained models; and the Zipf
stream of table 3 at its cap stored as auto and as int8.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from hurraykv.integrations.engine_run import run
from hurraykv.integrations.tiny_models import tiny_llama
from vllm_bench.engines import engine, hurray_conn
from vllm_bench.measurement import segment_bytes, tree_bytes
from vllm_bench.simulated import lru_hits
from vllm_bench.workloads import zipf_capped, zipf_workload

STORE_FORMATS = (("auto", {}), ("int8", {"store_dtype": "int8"}),
                 ("int8 per_channel", {"store_dtype": "int8", "quantization": "per_channel"}),
                 ("int4", {"store_dtype": "int4"}), ("fp8", {"store_dtype": "fp8"}))
FIRST_LOGPROBS = 5  # top logprobs returned for each decoded token (and the chosen one's)


def _batch_main(spec_path: str) -> int:
    """In an engine process: ``generate()`` of all the spec's prompts in one call (batched,
    ``max_num_seqs``), greedy, returning the chosen token's and the top
    ``spec["logprobs"]`` logprobs of the first decoded token (engine_run's driver returns
    tokens only)."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hurraykv.integrations.engine_run import connector_stats, engine_kwargs

    llm = LLM(**engine_kwargs(spec) | {"max_num_seqs": spec.get("max_num_seqs", 4)})
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False,
                            ignore_eos=True, logprobs=spec.get("logprobs"))
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                           params, use_tqdm=False)
    seconds = time.perf_counter() - t0

    def first(o) -> dict[str, float] | None:
        lps = o.outputs[0].logprobs
        return {str(k): float(v.logprob) for k, v in lps[0].items()} if lps else None

    result = {"outputs": [{"tokens": list(o.outputs[0].token_ids),
                           "num_cached_tokens": o.num_cached_tokens,
                           "first_logprobs": first(o)} for o in outputs],
              "seconds": seconds, "stats": connector_stats()}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def batch_engine(spec: dict, work: Path, name: str) -> dict:
    """One engine process (``engine_run.run``, forked from its vLLM-preloaded server)
    running ``_batch_main``: the accuracy runs need logprobs, not per-request times."""
    result = run(spec, work, name, timeout=900, entry=_batch_main)
    if result["code"] or "outputs" not in result:
        print(result["log"][-4000:], file=sys.stderr)
        raise SystemExit(f"bench_vllm: engine {name} failed")
    return result


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def layer_errors(store: Path, segments: int) -> dict[str, list[tuple[float, float]]]:
    """Per store format, per layer: the relative RMS error of K and V that
    ``store_format.reconstruction_error`` finds on the pages of the first ``segments``
    stored auto segments (each segment encoded alone, as the connector encodes it; the
    mean over the segments)."""
    import hurraykv as hk
    from hurraykv.integrations.vllm.store_format import decode, parse, reconstruction_error

    errors: dict[str, list[list[list[float]]]] = {}
    for path in sorted(store.glob("*.hrry"))[:segments]:
        snap = hk.load_snapshot(path)
        for layer in range(snap.num_layers):
            for r, role in enumerate(("key", "value")):
                t = snap.tensor(layer, role)
                pages = decode(t, 0, t.num_pages)
                for label, extra in STORE_FORMATS[1:]:
                    fmt = parse(extra["store_dtype"], "store_dtype",
                                extra.get("quantization"))
                    e = errors.setdefault(label, [])
                    while len(e) <= layer:
                        e.append([[], []])
                    e[layer][r].append(reconstruction_error(fmt, pages)["relative_rms"])
    return {label: [(float(np.mean(k)), float(np.mean(v))) for k, v in per_layer]
            for label, per_layer in errors.items()}


def store_dtype_accuracy(work: Path, tag: str, model: Path, dtype: str, n_prompts: int,
                         prompt_len: int, gen: int) -> tuple[list[tuple[str, ...]], dict]:
    """For each store format: store ``n_prompts`` seeded random prompts' KV (a producer
    engine, 1 token), then a fresh consumer engine of that format loads the stored prefix
    and decodes ``gen`` greedy tokens; compared with an engine without a connector."""
    prompts = [np.random.default_rng((41, i)).integers(1, 1000, prompt_len).tolist()
               for i in range(n_prompts)]
    stored_tokens = (prompt_len - 1) // 32 * 32

    def spec(connector: dict | None, max_tokens: int, logprobs: int | None = None) -> dict:
        return {"model": str(model), "dtype": dtype, "prompts": prompts,
                "max_tokens": max_tokens, "connector": connector, "block_size": 32,
                "max_num_seqs": 16, "logprobs": logprobs,
                "max_model_len": prompt_len + gen + 64}

    base = batch_engine(spec(None, gen, FIRST_LOGPROBS), work, f"{tag}-none")
    rows, extra_info = [], {"per_prompt": {}, "seconds": base["seconds"], "stores": {}}
    auto_per_token = None
    for label, extra in STORE_FORMATS:
        slug = label.replace(" ", "-")
        store = work / f"{tag}-{slug}"
        saved = batch_engine(spec(hurray_conn(store.as_uri(), "kv_producer", **extra), 1),
                             work, f"{tag}-{slug}-store")
        loaded = batch_engine(spec(hurray_conn(store.as_uri(), "kv_consumer", **extra), gen,
                                   FIRST_LOGPROBS), work, f"{tag}-{slug}-load")
        reused = [o["num_cached_tokens"] for o in loaded["outputs"]]
        same = diverged = 0
        firsts, deltas, missing = [], [], 0
        for o, b in zip(loaded["outputs"], base["outputs"], strict=True):
            at = first_divergence(o["tokens"], b["tokens"])
            if at is None:
                same += 1
            else:
                diverged += 1
                firsts.append(at)
            token = str(b["tokens"][0])  # the reference's first token, in both runs
            if token in o["first_logprobs"]:
                deltas.append(abs(o["first_logprobs"][token] - b["first_logprobs"][token]))
            else:
                missing += 1
        chunks = saved["stats"]["chunks_saved"]
        per_token = tree_bytes(store) / (chunks * 32)
        auto_per_token = auto_per_token or per_token
        extra_info["per_prompt"][label] = segment_bytes(store) / n_prompts
        extra_info["stores"][label] = store
        lp = (f"{max(deltas):.2g} / {np.mean(deltas):.2g}" if deltas else "-") + (
            f" ({missing} not in top {FIRST_LOGPROBS})" if missing else "")
        rows.append((label, f"{same}/{n_prompts} ({same / n_prompts:.0%})",
                     f"{np.mean(firsts):.1f} ({diverged} diverged)" if firsts else "-",
                     lp, f"{min(reused)}-{max(reused)} of {stored_tokens}",
                     f"{per_token:,.0f} B ({per_token / auto_per_token:.2f}x)"))
    return rows, extra_info


def store_dtype(work: Path, n_prompts: int, heavy_prompts: int, n_zipf: int, n_requests: int
                ) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    tiny = tiny_llama(work / "tiny-dtype")
    heavy = tiny_llama(work / "kv-heavy-dtype", layers=4, head_dim=128, kv_heads=8, heads=8)
    gen, prompt_len = 64, 200
    tiny_rows, tiny_info = store_dtype_accuracy(work, "dt-tiny", tiny, "float32", n_prompts,
                                                prompt_len, gen)
    heavy_rows, heavy_info = store_dtype_accuracy(work, "dt-heavy", heavy, "bfloat16",
                                                  heavy_prompts, prompt_len, gen)
    head = ("model", "store dtype", f"prompts with all {gen} tokens = no connector",
            "first divergence, mean token index", "first token logprob |diff| max / mean",
            "tokens loaded per prompt", "stored bytes per token (vs auto)")
    rows = [("tiny Llama float32", *r) for r in tiny_rows]
    rows += [("4 layers x 8 KV heads x 128, bfloat16", *r) for r in heavy_rows]
    title = (f"Store dtypes on RANDOM-WEIGHT models (std 0.1 weights: token agreement here "
             f"says little about a trained model; the per-layer error below carries over): "
             f"{n_prompts} (tiny Llama, float32) and {heavy_prompts} (4 layers x 8 KV heads "
             f"x 128, bfloat16) seeded random prompts of {prompt_len} tokens; an engine of "
             f"each store dtype stores them, a fresh one of the same store dtype loads the "
             f"stored {(prompt_len - 1) // 32 * 32}-token prefix and decodes {gen} greedy "
             f"tokens (generate() of all prompts, 16 at a time); compared with the same "
             f"engine without a connector (logprob: of its first token, in both)")
    tables = [(title, head, rows)]

    # per-layer reconstruction error on the models' own stored KV
    segments = 8
    errs = {"tiny Llama": layer_errors(tiny_info["stores"]["auto"], segments),
            "4x8x128 bf16": layer_errors(heavy_info["stores"]["auto"], segments)}
    labels = [label for label, _ in STORE_FORMATS[1:]]
    erows = []
    for model_name, per_fmt in errs.items():
        for layer in range(len(per_fmt[labels[0]])):
            erows.append((f"{model_name}, layer {layer}", *(
                f"K {per_fmt[f][layer][0]:.2%} / V {per_fmt[f][layer][1]:.2%}"
                for f in labels)))
    tables.append((
        f"Reconstruction error of the stored KV (store_format.reconstruction_error: RMS of "
        f"the error over RMS of the values, each of the first {segments} stored auto "
        f"segments encoded alone, mean): the models' real K and V pages, random weights "
        f"(no outlier channels, which trained models' keys have: see docs/vllm.md)",
        ("model, layer", *labels), erows))

    # capacity: the Zipf table's workload at its cap, stored as auto and as int8
    prompts, stream, zspec = zipf_workload(tiny, n_zipf, n_requests)
    distinct = len(set(stream))
    prompt_tokens = sum(len(prompts[i]) for i in stream)
    per_prompt = tiny_info["per_prompt"]  # the same model and prompt length as stored above
    cap = int(per_prompt["auto"] * n_zipf / 4)
    none = engine(zspec(None), work, "dt-zipf-none")
    zrows = []
    for label in ("auto", "int8"):
        extra = dict(STORE_FORMATS)[label]
        r, peak, final = zipf_capped(work, zspec, cap, f"dt-zipf-{label}", **extra)
        cached = [o["num_cached_tokens"] for o in r["outputs"]]
        hit = sum(c > 0 for c in cached)
        same = sum(o["tokens"] == b["tokens"] for o, b in zip(r["outputs"], none["outputs"],
                                                             strict=True))
        slots = int(cap // per_prompt[label])
        ideal = lru_hits(stream, slots)
        zrows.append((label, f"{per_prompt[label] / 1024:.0f} KiB", f"{slots}",
                      f"{hit}/{n_requests} ({hit / n_requests:.0%})",
                      f"{sum(cached) / prompt_tokens:.0%}",
                      f"{ideal}/{n_requests} ({ideal / n_requests:.0%})",
                      f"{same}/{n_requests}",
                      f"{final / 1024:.0f} KiB, peak {peak / 1024:.0f} KiB ("
                      + ("within" if peak <= cap else f"OVER the cap by {(peak - cap) / 1024:.0f}"
                         " KiB") + f"; {r['stats'].get('evictions', 0)} evicted)"))
    zrows.append(("any unbounded store (simulated)", "", "",
                  f"{n_requests - distinct}/{n_requests} ({1 - distinct / n_requests:.0%})",
                  "", "", "", ""))
    tables.append((
        f"Capacity: the Zipf stream of the table above ({n_requests} requests over {n_zipf} "
        f"prompts, {distinct} drawn, tiny Llama float32, 4 tokens each, one engine per row) "
        f"at max_bytes = {cap / 1024:.0f} KiB (a quarter of the prompts as auto stores them), "
        f"stored as auto and as int8 (a float32 cache: int8 holds a quarter of its bytes, "
        f"plus scales and segment headers)",
        ("store dtype", "a prompt as stored", "prompts that fit", "requests reusing KV",
         "prompt tokens reused", "exact LRU of that many (simulated)",
         "outputs = no connector", "stored at the end (peak)"), zrows))
    return tables
