"""``make demo-vllm``: disaggregated prefill and decode, two vLLM engines and a hurraykv server.

A tiny random Llama is created here (nothing downloaded).  A ``hurraykv serve`` starts on
loopback; a prefill engine (``kv_role`` kv_producer, HurrayConnector) computes a batch of
prompts - one of them long - and pushes their KV chunks to the server; a decode engine
(kv_consumer) in another process loads them into the blocks its allocator chose and
decodes.  A third engine without any connector decodes the same batch as the reference.
Prints the tokens reused per prompt and the time to first token of the long prompt with
and without the handoff; exits non-zero unless every decoded token equals the reference.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .integrations.engine_run import run
from .integrations.tiny_models import tiny_llama

LONG = 2048
BLOCK = 32


def _spec(model: Path, prompts: list[list[int]], max_tokens: int, connector: dict | None,
          rounds: int | None = None) -> dict:
    return {"model": str(model), "dtype": "float32", "prompts": prompts,
            "max_tokens": max_tokens, "connector": connector, "block_size": BLOCK,
            "max_model_len": LONG + 256, "num_blocks": 512, "rounds": rounds}


def _connector(address: str, role: str) -> dict:
    url = f"hurray://{address}"
    return {"url": url, "role": role, "extra": {"url": url}}


def _check(result: dict, what: str) -> dict:
    if result["code"]:
        print(result["log"][-4000:], file=sys.stderr)
        raise SystemExit(f"demo-vllm: the {what} engine failed")
    return result


def main() -> int:
    rng = np.random.default_rng(2026)
    system = rng.integers(1, 1000, 96).tolist()  # a shared system prompt
    prompts = [rng.integers(1, 1000, LONG).tolist()] + [
        system + rng.integers(1, 1000, n).tolist() for n in (41, 77, 130)]
    with tempfile.TemporaryDirectory(prefix="hurraykv-demo-vllm-") as tmp:
        work = Path(tmp)
        model = tiny_llama(work / "tiny-llama")
        server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                                   "127.0.0.1:0", "--log-level", "warning"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            address = server.stdout.readline().split()[-1]
            print(f"hurraykv serve on {address}; tiny Llama (2 layers, 2 KV heads x 32) in "
                  f"{model}")
            prefill = _check(run(_spec(model, prompts, 1, _connector(address, "kv_producer")),
                                 work, "prefill"), "prefill")
            decode = _check(run(_spec(model, prompts, 16, _connector(address, "kv_consumer")),
                                work, "decode"), "decode")
            # time to first token of the long prompt, one request at a time
            ttft_hit = _check(run(_spec(model, prompts[:1], 1,
                                        _connector(address, "kv_consumer"), rounds=5),
                                  work, "ttft-hit"), "decode")
        finally:
            server.terminate()
            server.wait(10)
        reference = _check(run(_spec(model, prompts, 16, None), work, "reference"),
                           "reference")
        ttft_cold = _check(run(_spec(model, prompts[:1], 1, None, rounds=5), work,
                               "ttft-cold"), "reference")
    print(f"prefill engine stored {prefill['stats'].get('chunks_saved', 0)} chunks of "
          f"{BLOCK} tokens")
    ok = True
    for i, (p, got, want) in enumerate(zip(prompts, decode["outputs"], reference["outputs"],
                                           strict=True)):
        same = got["tokens"] == want["tokens"]
        ok &= same
        print(f"  prompt {i}: {len(p):5d} tokens, {got['num_cached_tokens']:5d} reused from "
              f"the prefill engine, 16 tokens decoded "
              f"{'identical to' if same else 'DIFFERENT from'} a plain engine")
    hit, cold = np.median(ttft_hit["times"]), np.median(ttft_cold["times"])
    print(f"time to first token, {LONG}-token prompt: {hit * 1e3:.1f} ms with the handoff, "
          f"{cold * 1e3:.1f} ms with a cold prefill ({cold / hit:.1f}x)")
    print("demo-vllm OK" if ok else "demo-vllm FAILED: tokens differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
