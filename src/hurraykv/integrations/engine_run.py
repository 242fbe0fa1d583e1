"""One vLLM engine in its own process, as one deployment would run it:
``python -m hurraykv.integrations.engine_run SPEC.json`` builds ``LLM(...)`` from the spec,
generates greedily for its prompts and prints one line ``RESULT {json}`` with each
output's tokens, ``num_cached_tokens`` and the timings, plus the connector's counters
when one is configured.  Used by ``make demo-vllm``, the real-engine tests and the vLLM
benchmark; ``tiny_llama`` makes the random model they share (nothing is downloaded).

Spec keys: ``model`` (directory), ``dtype``, ``kv_cache_dtype``, ``prompts`` (lists of
token ids), ``max_tokens``, ``connector`` (None, or ``{"url", "role", "extra",
"name", "module"}``), ``block_size``, ``rounds`` (generate the prompts this many
times, one request at a time, timing each), ``env``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def tiny_llama(path: str | os.PathLike, *, seed: int = 0, layers: int = 2,
               head_dim: int = 32, kv_heads: int = 2) -> Path:
    """A random LlamaForCausalLM (std 0.1 weights, so keys differ visibly), saved with
    ``save_pretrained``.  CPU attention needs head sizes of 32, 64, 80, ... (not 16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=4 * head_dim, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=8192)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path)
    return Path(path)


def run(spec: dict, workdir: str | os.PathLike, name: str = "engine",
        timeout: float = 600) -> dict:
    """Run one engine in a fresh process; its result, with ``log`` (stderr) and ``code``."""
    path = Path(workdir) / f"{name}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "hurraykv.integrations.engine_run",
                           str(path)], capture_output=True, text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    return result | {"log": proc.stderr, "code": proc.returncode if lines else
                     proc.returncode or 1}


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
