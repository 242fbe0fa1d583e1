"""One vLLM engine in its own process, as one deployment would run it:
``python -m hurraykv.integrations.engine_run SPEC.json`` builds ``LLM(...)`` from the spec,
generates greedily for its prompts and prints one line ``RESULT {json}`` with each
output's tokens, ``num_cached_tokens`` and the timings, plus the connector's counters
when one is configured.  Used by ``make demo-vllm``, the real-engine tests and the vLLM
benchmark; the random models they run are built by ``tiny_models.py`` (nothing is
downloaded).

Spec keys: ``model`` (directory), ``dtype``, ``kv_cache_dtype``, ``prompts`` (lists of
token ids), ``max_tokens``, ``connector`` (None, or ``{"url", "role", "extra",
"name", "module"}``), ``block_size``, ``rounds`` (generate the prompts this many
times, one request at a time, timing each), ``env``, ``tensor_parallel_size`` and
``distributed_executor_backend``, ``max_num_batched_tokens``,
``disable_hybrid_kv_cache_manager``, ``cache_salts`` and ``kv_transfer_params`` (per
prompt, None for none), ``num_blocks`` (None: as much as
``VLLM_CPU_KVCACHE_SPACE`` holds), ``time_connector`` (also time the
connector's own calls in each request: ``connector_times``), ``logprobs`` (each output's
``logprobs``: per generated token, the top N log-probabilities and the chosen token's)."""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run(spec: dict, workdir: str | os.PathLike, name: str = "engine",
        timeout: float = 600, entry: Any = None) -> dict:
    """Run one engine in a fresh process; its result, with ``log`` (stderr) and ``code``.

    The process is forked from a server that has imported vLLM once (``forkserver``
    with vLLM preloaded: importing it costs ~8 s a process on 2 cores), so each engine
    still starts from nothing but vLLM's import: no engine, connector or cache state is
    shared.  ``HURRAYKV_ENGINE_FORK=0`` runs each in a new interpreter instead.  ``entry``:
    a module-level function ``entry(spec_path) -> exit status`` run in the engine process
    instead of ``main`` (it prints its own ``RESULT`` line; always forked)."""
    path = Path(workdir) / f"{name}.json"
    path.write_text(json.dumps(spec))
    out, err = Path(workdir) / f"{name}.stdout", Path(workdir) / f"{name}.stderr"
    if entry is None and os.environ.get("HURRAYKV_ENGINE_FORK", "1") == "0":
        with open(out, "w") as o, open(err, "w") as e:
            try:
                code = subprocess.run([sys.executable, "-m", "hurraykv.integrations.engine_run",
                                       str(path)], stdout=o, stderr=e, timeout=timeout
                                      ).returncode
            except subprocess.TimeoutExpired:
                code = -9
    else:
        proc = _forkserver().Process(target=_child, args=(str(path), str(out), str(err),
                                                          entry))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        code = proc.exitcode if proc.exitcode is not None else -9
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    # vLLM's log handler writes to stdout: the log is both streams but the result
    log = "".join(x + "\n" for x in stdout.splitlines() if not x.startswith("RESULT ")) + stderr
    return result | {"log": log, "code": code if lines else code or 1}


@functools.cache
def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hurraykv.integrations._engine_preload"])
    return ctx


def _child(spec_path: str, out: str, err: str, entry: Any = None) -> None:
    """In the forked process: stdout and stderr to files (fds 1 and 2: vLLM's workers and
    C++ code write there too), then ``main`` (or ``entry``); its status is the process's."""
    for fd, target in ((1, out), (2, err)):
        f = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [sys.argv[0], spec_path]
    code = main() if entry is None else entry(spec_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def engine_kwargs(spec: dict) -> dict:
    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
              enforce_eager=True, max_model_len=spec.get("max_model_len", 1024),
              max_num_seqs=4, block_size=spec.get("block_size", 32), seed=0,
              num_gpu_blocks_override=spec.get("num_blocks", 256),
              enable_prefix_caching=spec.get("prefix_caching", False),
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"))
    for key in ("tensor_parallel_size", "distributed_executor_backend",
                "max_num_batched_tokens", "disable_hybrid_kv_cache_manager"):
        if key in spec:
            kw[key] = spec[key]
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
    """The worker-side connector's counters (the engine core runs in this process), with
    its tiers' (``tier_hits.0``: what the worker's stack counted; its lookups are the
    scheduler's)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from .vllm.metrics import tier_payload

        connector = get_kv_transfer_group()
        if hasattr(connector, "drain"):
            connector.drain()  # the background writes are part of what was stored
        tiers = getattr(getattr(connector, "ctx", None), "tier_counts", None)
        return dict(getattr(connector, "stats", {})) | tier_payload(tiers)
    except Exception:  # no connector configured, or one without counters
        return {}


def _time_connector() -> list[float]:
    """Wrap every public method of the engine's connector class so the time spent inside
    them (outermost call only) adds up in the returned one-element list."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    cls = type(get_kv_transfer_group())
    spent, local = [0.0], __import__("threading").local()
    names = {n for k in cls.__mro__ if k is not object for n, v in vars(k).items()
             if inspect.isfunction(v) and not n.startswith("_")}

    def timed(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if getattr(local, "inside", False):
                return fn(*args, **kwargs)
            local.inside, started = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
                local.inside = False
        return call

    for name in names:
        setattr(cls, name, timed(getattr(cls, name)))
    return spent


def _patch_dispatcher() -> None:
    """For LMCache's benchmark process only: its numba import leaves objects whose
    ``vars()`` has no ``.get``, which vLLM 0.32's kernel registry
    (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``) trips over."""
    import builtins

    import vllm.triton_utils.dispatcher as dispatcher

    def safe_vars(obj: object) -> dict:
        try:
            found = builtins.vars(obj)
        except TypeError:
            return {}
        return found if hasattr(found, "get") else {}

    dispatcher.vars = safe_vars  # type: ignore[attr-defined]


def _logprobs(output: Any) -> list[dict[str, float]] | None:
    """Per generated token, the log-probabilities vLLM returned (spec ``logprobs``: the
    top N and the chosen token), by token id."""
    steps = output.outputs[0].logprobs
    return [{str(k): float(v.logprob) for k, v in step.items()} for step in steps] \
        if steps else None


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("patch_dispatcher"):
        _patch_dispatcher()
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    startup = time.perf_counter() - started
    if spec.get("touch_kv_cache"):
        # as after warm-up: every page of the engine's KV cache memory has been written
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
        for cache in runner.worker.model_runner.kv_caches:
            cache.zero_()
    spent = _time_connector() if spec.get("time_connector") and spec.get("connector") \
        else None
    connector_times = []
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8),
                            detokenize=False, ignore_eos=True, logprobs=spec.get("logprobs"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    for p, salt in zip(prompts, spec.get("cache_salts") or (), strict=False):
        if salt:
            p["cache_salt"] = salt
    # per prompt, as the OpenAI server passes its top-level field (extra_args)
    asks = spec.get("kv_transfer_params") or [None] * len(prompts)
    each = [params if ask is None else SamplingParams(
        temperature=0, max_tokens=spec.get("max_tokens", 8), detokenize=False,
        ignore_eos=True, logprobs=spec.get("logprobs"),
        extra_args={"kv_transfer_params": ask}) for ask in asks]
    outputs, times, round_stats = [], [], []
    if spec.get("rounds"):
        for _ in range(spec["rounds"]):
            for p, sampling in zip(prompts, each, strict=True):
                t0, c0 = time.perf_counter(), spent[0] if spent else 0.0
                out = llm.generate([p], sampling, use_tqdm=False)[0]
                times.append(time.perf_counter() - t0)
                if spent:
                    connector_times.append(spent[0] - c0)
                outputs.append(out)
            if spec.get("round_stats"):  # the counters after each round (cumulative)
                round_stats.append(connector_stats())
    else:
        outputs = llm.generate(prompts, each, use_tqdm=False)
    result = {"outputs": [{"tokens": list(o.outputs[0].token_ids),
                           "num_cached_tokens": o.num_cached_tokens,
                           "logprobs": _logprobs(o)} for o in outputs],
              "times": times, "startup": startup, "stats": connector_stats(),
              "connector_times": connector_times, "round_stats": round_stats}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
