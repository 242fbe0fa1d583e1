"""One vLLM engine in its own process, as one deployment: ``python -m engine_tests.driver
SPEC.json`` builds ``LLM(...)`` from the spec, generates greedily for its prompts and
prints one line ``RESULT {json}`` with each output's tokens, ``num_cached_tokens`` and
the timings, plus the connector's counters when one is configured.

Spec keys: ``model`` (directory), ``dtype``, ``kv_cache_dtype``, ``prompts`` (lists of
token ids), ``max_tokens``, ``connector`` (None, or ``{"url", "role", "extra",
"name", "module"}``), ``block_size``, ``rounds`` (generate the prompts this many
times, one request at a time, timing each), ``env``."""

from __future__ import annotations

import json
import os
import sys
import time


def engine_kwargs(spec: dict) -> dict:
    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
              enforce_eager=True, max_model_len=spec.get("max_model_len", 1024),
              max_num_seqs=4, block_size=spec.get("block_size", 32), seed=0,
              num_gpu_blocks_override=spec.get("num_blocks", 256),
              enable_prefix_caching=spec.get("prefix_caching", False),
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"))
    conn = spec.get("connector")
    if conn:
        kw["kv_transfer_config"] = {
            "kv_connector": conn.get("name", "HurrayConnector"),
            "kv_role": conn.get("role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": conn.get("extra", {"url": conn.get("url")}),
        }
        if conn.get("module", "hurraykv.integrations.vllm"):
            kw["kv_transfer_config"]["kv_connector_module_path"] = conn.get(
                "module", "hurraykv.integrations.vllm")
    return kw


def connector_stats() -> dict:
    """The worker-side connector's counters (the engine core runs in this process)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(getattr(get_kv_transfer_group(), "stats", {}))
    except Exception:  # no connector configured, or one without counters
        return {}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8),
                            detokenize=False, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    outputs, times = [], []
    if spec.get("rounds"):
        for _ in range(spec["rounds"]):
            for p in prompts:
                t0 = time.perf_counter()
                out = llm.generate([p], params, use_tqdm=False)[0]
                times.append(time.perf_counter() - t0)
                outputs.append(out)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"outputs": [{"tokens": list(o.outputs[0].token_ids),
                           "num_cached_tokens": o.num_cached_tokens} for o in outputs],
              "times": times, "startup": startup, "stats": connector_stats()}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
