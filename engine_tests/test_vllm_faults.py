"""The connector never takes vLLM down or stalls it: stores stopped, hung and full, files
cut underneath a load, an operator's clean-up, tensor parallelism over ``file://``.

Outages happen between the steps of one running engine (in this process, so the test
stops and continues the store around it); every output is compared token by token with
an engine without a connector, and the connector's log lines are counted per outage."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.integrations.vllm.test_vllm_stalls import LOAD_S, LOOKUP_S, MARGIN
from tests.support.holding_proxy import HoldingProxy
from tests.support.redis_servers import free_port, redis_server_binary, start_redis

from engine_tests.conftest import Engine, ask, run_engine, skip_unless_cpu_takes
from engine_tests.test_vllm_connector import BLOCK, conn, prompts, spec, stored_both
from hurraykv import errors as hk_errors
from hurraykv.integrations import engine_run
from hurraykv.net.messages import MessageType as T


@pytest.fixture(scope="module")
def want(tiny_llama, plain_run) -> list[list[int]]:
    """Greedy tokens of both prompts from an engine without a connector."""
    return [o["tokens"] for o in plain_run(spec(tiny_llama, None, list(prompts())))["outputs"]]


class Lines(logging.Handler):
    """The connector's log records (vLLM's "vllm" logger does not propagate to root)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in m for m in self.messages)


@pytest.fixture
def lines():
    """Call it once the engine exists: vLLM's engine start applies its logging config,
    which clears the handlers of every logger under "vllm"."""
    attached: list[Lines] = []

    def listen() -> Lines:
        handler = Lines()
        logging.getLogger("vllm.hurraykv").addHandler(handler)
        attached.append(handler)
        return handler

    yield listen
    for handler in attached:
        logging.getLogger("vllm.hurraykv").removeHandler(handler)


def generate(eng: Engine, prompts_: list[list[int]], salts: list[str | None] | None = None,
             kv_transfer_params: dict | None = None,
             after_step: Callable[[], object] | None = None
             ) -> tuple[list[list[int]], list[int], float]:
    """(tokens, num_cached_tokens, seconds) of one batch of requests, in prompt order
    (``salts``: each request's ``cache_salt``; ``kv_transfer_params`` as the OpenAI server
    passes its top-level field: ``SamplingParams.extra_args``,
    ``vllm/entrypoints/openai/completion/protocol.py:380``); ``after_step`` is called
    once, after the engine's first step (its requests under way)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params}
                            if kv_transfer_params else None)
    started = time.monotonic()
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts_))]
    for rid, p, salt in zip(ids, prompts_, salts or [None] * len(ids), strict=True):
        prompt = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            prompt["cache_salt"] = salt
        eng.llm.llm_engine.add_request(rid, prompt, params)
    done = {}
    while eng.llm.llm_engine.has_unfinished_requests():
        for out in eng.llm.llm_engine.step():
            if out.finished:
                done[out.request_id] = out
        if after_step is not None:
            after_step, call = None, after_step
            call()
    return ([list(done[r].outputs[0].token_ids) for r in ids],
            [done[r].num_cached_tokens for r in ids], time.monotonic() - started)


def test_redis_stopped_hung_and_back_never_fails_a_request(tiny_llama, tmp_path, want, lines):
    port = free_port()
    redis = start_redis(redis_server_binary(), tmp_path, port)
    url = f"redis://127.0.0.1:{port}"
    eng = Engine(tiny_llama, block_size=BLOCK, connector=conn(url, max_backoff_s=1.0))
    lines = lines()
    both = list(prompts())
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    try:
        tokens, cached, healthy = generate(eng, both)
        assert tokens == want and cached == [0, 0]
        worker.drain()  # stored by the writer thread before they are looked up again
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == [192, 160]  # stored, then found
        redis.send_signal(signal.SIGSTOP)  # hung: accepts nothing, answers nothing
        for _ in range(3):
            tokens, cached, seconds = generate(eng, both)
            assert tokens == want and cached == [0, 0]
            # a lookup waits its deadline once; the rest are skipped at once
            assert seconds < healthy + LOOKUP_S + MARGIN
        redis.kill()  # stopped for good, mid-run (SIGKILL reaches a stopped process)
        redis.wait(10)
        lookups = eng.core.scheduler.connector.lookups
        # until the lookups see it down: one batched lookup a round, the first maybe
        # skipped while the hung call ends, so how many rounds that takes is timing
        for _ in range(8):
            tokens, _, _ = generate(eng, both)
            assert tokens == want
            if lookups.stats["outages"]:
                break
        # one line per outage and connection (lookups, loads, saves), not per request
        assert 1 <= lines.count("is failing") <= 3, lines.messages
        failing = lines.count("is failing")
        redis = start_redis(redis_server_binary(), tmp_path, port)  # back, empty
        time.sleep(1.2)  # past the backoff: the next lookup probes it
        tokens, _, _ = generate(eng, both)
        worker.drain()
        tokens2, cached, _ = generate(eng, both)
        assert tokens == want and tokens2 == want and cached == [192, 160]
        assert lines.count("is back") >= 1 and lines.count("is failing") == failing
        assert lookups.stats["outages"] == 1  # one outage, however long
    finally:
        with contextlib.suppress(Exception):
            redis.send_signal(signal.SIGCONT)
        redis.kill()
        eng.close()


def test_a_hung_hurraykv_server_stalls_no_request(tiny_llama, tmp_path, want, lines):
    """Loads across steps (``load_mode`` auto: async for ``hurray://``).  A server that
    answers lookups and hangs on a fetch (a proxy holds the fetch's request): the hit's
    request waits ``load_timeout_ms`` in ``WAITING_FOR_REMOTE_KVS`` and recomputes (vLLM
    then counts none of its tokens cached), while a request that needs nothing from the
    store runs as if the store were healthy.  A server that hangs altogether (SIGSTOP):
    vLLM's scheduler thread never waits on it (each ``get_num_new_matched_tokens``
    returns at once), a request waits at most its lookup's deadline, then computes.  The
    waits are measured in the engine, against the values docs/vllm.md gives."""
    from tests.integrations.vllm.test_vllm_stalls import QUICK

    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proxy = HoldingProxy(server.stdout.readline().split()[-1])
    eng = Engine(tiny_llama, block_size=BLOCK, connector=conn(f"hurray://{proxy.address}"))
    lines = lines()
    both = list(prompts())
    scheduler = eng.core.scheduler.connector
    waits: list[float] = []  # of each lookup, as vLLM's scheduler calls it
    matched = scheduler.get_num_new_matched_tokens

    def timed(*args):
        started = time.monotonic()
        try:
            return matched(*args)
        finally:
            waits.append(time.monotonic() - started)

    scheduler.get_num_new_matched_tokens = timed
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        stats = worker.stats
        _, _, computed = generate(eng, both)
        worker.drain()  # stored by the writer thread before they are looked up again
        tokens, cached, healthy = generate(eng, both)
        assert tokens == want and cached == [192, 160]
        assert stats["loads_async"] == 2 and stats["loads_sync"] == 0

        proxy.hold(T.TENSOR_REQUEST)
        failed = stats["chunks_failed"]
        other = [7, *both[1][1:]]  # stored nowhere: a miss, computed at once
        finish = finish_times(eng, [*both, other])
        tokens = [t for t, _, _ in finish[:2]]
        assert tokens == want  # recomputed, every token
        assert [c for _, c, _ in finish[:2]] == [0, 0]  # vLLM counts what was loaded
        # the first fetch hung; the second, while it had not returned, was not tried
        assert proxy.held[T.TENSOR_REQUEST] == 1
        assert stats["chunks_failed"] - failed == 6 + 5  # all recomputed
        assert LOAD_S <= max(s for _, _, s in finish[:2]) < computed + LOAD_S + MARGIN
        # the request that needed nothing from the store did not wait for the hung load
        assert finish[2][2] < computed + MARGIN < LOAD_S, finish
        proxy.release()

        server.send_signal(signal.SIGSTOP)
        waits.clear()
        for _ in range(3):
            tokens, cached, seconds = generate(eng, both)
            assert tokens == want and cached == [0, 0]
            assert seconds < healthy + LOOKUP_S + MARGIN
        # never the scheduler thread: every call returned at once
        assert max(waits) < QUICK, sorted(waits)[-5:]
    finally:
        server.send_signal(signal.SIGCONT)
        proxy.close()
        server.terminate()
        server.wait(10)
        eng.close()


def hung_fetch_engine(tiny_llama, tmp_path, stack, **extra):
    """An engine over a ``hurraykv serve`` behind a proxy, both prompts stored: the proxy
    can hold the fetches of the next loads."""
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack.callback(lambda: (server.terminate(), server.wait(10)))
    proxy = HoldingProxy(server.stdout.readline().split()[-1])
    stack.callback(proxy.close)
    stack.callback(proxy.release)
    eng = Engine(tiny_llama, block_size=BLOCK, num_blocks=24, max_model_len=512,
                 connector=conn(f"hurray://{proxy.address}", **extra))
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    generate(eng, list(prompts()))
    worker.drain()
    return eng, proxy, worker


def add_one(eng: Engine, prompt: list[int]) -> str:
    """Add one greedy request of 8 tokens; its id as the scheduler knows it (vLLM
    suffixes the id it is given)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = set(eng.core.scheduler.requests)
    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True)
    eng.llm.llm_engine.add_request(f"r{time.monotonic_ns()}",
                                   TokensPrompt(prompt_token_ids=prompt), params)
    eng.step()
    (rid,) = set(eng.core.scheduler.requests) - before
    return rid


def wait_for_status(eng: Engine, rid: str, status: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        req = eng.core.scheduler.requests.get(rid)
        if req is not None and req.status.name == status:
            return
        eng.step()
        time.sleep(0.001)
    req = eng.core.scheduler.requests.get(rid)
    raise AssertionError(f"{rid} never reached {status}: "
                         f"{None if req is None else (req.status, req.num_computed_tokens)}")


def test_a_request_aborted_while_its_load_hangs_frees_its_blocks_and_is_never_written(
        tiny_llama, tmp_path, want, plain_run):
    """The fetch of a hit hangs: vLLM holds the request in ``WAITING_FOR_REMOTE_KVS``.
    It is aborted: the connector reports it at the next step, vLLM frees its blocks and
    gives them to other requests (24 blocks: the next ones reuse them), and when the store
    answers at last nothing is written into them - the requests running there give an
    engine's tokens without a connector, and no byte of the late fetch is written."""
    first, second = prompts()
    with contextlib.ExitStack() as stack:
        eng, proxy, worker = hung_fetch_engine(tiny_llama, tmp_path, stack,
                                               load_timeout_ms=60_000)
        stack.callback(eng.close)
        manager = eng.core.scheduler.kv_cache_manager
        free = manager.block_pool.get_num_free_blocks()
        proxy.hold(T.TENSOR_REQUEST)
        held = add_one(eng, first)
        wait_for_status(eng, held, "WAITING_FOR_REMOTE_KVS")
        assert proxy.wait_held(T.TENSOR_REQUEST)
        held_blocks = set(manager.get_block_ids(held)[0])
        assert manager.block_pool.get_num_free_blocks() < free
        written = worker.stats["layers_written"]
        eng.llm.llm_engine.abort_request([held], internal=True)
        started = time.monotonic()
        while held in eng.core.scheduler.requests:
            eng.step()
            assert time.monotonic() - started < 1.0, "the aborted request's blocks stay held"
        assert manager.block_pool.get_num_free_blocks() == free
        assert worker.stats["loads_cancelled"] == 1
        # the next requests run in those blocks (the second's hit waits behind the held
        # fetch; the other prompt is stored nowhere), and the late answer comes meanwhile:
        # a stray write of the first prompt's chunks would change their tokens
        other = [7, *second[1:]]
        nexts = [add_one(eng, p) for p in (second, other)]
        for _ in range(1000):
            if all(manager.get_block_ids(rid)[0] for rid in nexts):
                break
            eng.step()
            time.sleep(0.001)
        reused = {b for rid in nexts for b in manager.get_block_ids(rid)[0]}
        assert reused & held_blocks, "the freed blocks went elsewhere: the test proves nothing"
        proxy.release()
        assert worker.worker.loader.wait_idle(10)
        done = eng.run_to_end()  # by the ids given (vLLM's without its suffix)
        tokens = [done[rid.rsplit("-", 1)[0]] for rid in nexts]
        assert tokens[0] == want[1]
        reference = plain_run(spec(tiny_llama, None, [other]))
        assert tokens[1] == reference["outputs"][0]["tokens"]
        # the second's load wrote its 2 layers (or failed); the aborted one's never did
        assert worker.stats["layers_written"] - written in (0, 2)


def test_shutdown_with_a_load_in_flight_is_bounded(tiny_llama, tmp_path):
    """The engine stops while a load waits on a hung store: the connector's shutdown
    cancels it and waits at most ``load_timeout_ms`` for the loader."""
    with contextlib.ExitStack() as stack:
        eng, proxy, worker = hung_fetch_engine(tiny_llama, tmp_path, stack,
                                               load_timeout_ms=1_000)
        proxy.hold(T.TENSOR_REQUEST)
        late = add_one(eng, prompts()[0])
        wait_for_status(eng, late, "WAITING_FOR_REMOTE_KVS")
        assert proxy.wait_held(T.TENSOR_REQUEST)
        started = time.monotonic()
        worker.shutdown()
        assert time.monotonic() - started < 1.0 + 1.0 + MARGIN
        assert worker.worker.loader.in_flight <= 1
        eng.close()


def finish_times(eng: Engine, prompts_: list[list[int]]) -> list[tuple[list[int], int, float]]:
    """(tokens, num_cached_tokens, seconds until it finished) per request, all added at
    once, stepped as vLLM's engine loop steps them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True)
    ids = [f"f{time.monotonic_ns()}-{i}" for i in range(len(prompts_))]
    started = time.monotonic()
    for rid, p in zip(ids, prompts_, strict=True):
        eng.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    done: dict[str, tuple[list[int], int, float]] = {}
    while eng.llm.llm_engine.has_unfinished_requests():
        for out in eng.llm.llm_engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids),
                                        out.num_cached_tokens, time.monotonic() - started)
        time.sleep(0.001)  # vLLM's loop, on a step with no forward pass
    return [done[r] for r in ids]


def test_segments_cut_underneath_loads_are_recomputed_never_a_signal(tiny_llama, tmp_path,
                                                                     want, tmp_path_factory):
    """Segments truncated in place while an engine keeps loading them: SIGBUS killed the
    worker when segments were mapped; read, a short file is a recompute.  One engine (in a
    process of its own: a signal would end it, not the test run) loads the two prompts'
    stored chunks, 6 and 5 a round, from the segments whole, then cut short, then while a
    thread cuts and mends them: every chunk vLLM took from the store is loaded or counted
    failed, and the tokens are an engine's without a connector every time."""
    store = tmp_path / "kv"
    both = list(prompts())
    stored_both(tmp_path_factory, tiny_llama, store)
    # a consumer: nothing it recomputes is stored again over the files being cut
    out = engine_run.run(spec(tiny_llama, conn(store.as_uri(), "kv_consumer"), both),
                         tmp_path, "loads", entry=_load_whole_cut_and_racing)
    assert out["code"] == 0, out["log"][-6000:]
    whole, cut, *racing = out["phases"]
    assert [p["tokens"] for p in out["phases"]] == [want] * (2 + len(racing))
    assert whole["cached"] == [192, 160] and whole["counts"] == [6 + 5, 0, 0]
    # vLLM counts what it took from the store when it schedules the load; each of those
    # chunks failed, and those in the segment a request read first count as damaged (its
    # chunks after them failed before their segment was read)
    assert cut["cached"] == [192, 160]
    damaged = sum(names.count(names[0]) for names in out["located"])
    assert cut["counts"] == [6 + 5, 6 + 5, damaged]
    took = sum(sum(p["cached"]) for p in racing) // BLOCK
    loaded, failed, _ = racing[-1]["counts"]
    assert loaded + failed == 2 * (6 + 5) + took


def _load_whole_cut_and_racing(spec_path: str) -> int:
    """In the engine process (``engine_run.run``'s ``entry``): the spec's prompts loaded
    from their stored segments whole, cut to a third, then 4 times while a thread cuts and
    mends them; per phase the tokens, ``num_cached_tokens`` and the counters (loaded,
    failed, damaged chunks), with where the scheduler finds each prompt's chunks."""
    spec = json.loads(Path(spec_path).read_text())
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                       ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_NO_USAGE_STATS", "1")):
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from hurraykv.chunks.file.store import FileChunks
    from hurraykv.chunks.keys import ChunkKeys

    llm = LLM(**engine_run.engine_kwargs(spec))
    connector = get_kv_transfer_group()
    store = Path(connector.ctx.url.removeprefix("file://"))
    located = [FileChunks(store).locate(ChunkKeys(connector.seed, BLOCK).upto(p, n))
               for p, n in zip(spec["prompts"], (6, 5), strict=True)]
    whole = {p: p.read_bytes() for p in sorted(store.glob("*.hrry"))}
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False,
                            ignore_eos=True)
    prompts_ = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    stats = connector.stats
    phases = []

    def run() -> None:
        outs = llm.generate(prompts_, params, use_tqdm=False)
        phases.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                       "cached": [o.num_cached_tokens for o in outs],
                       "counts": [stats["chunks_loaded"], stats["chunks_failed"],
                                  stats["chunks_corrupt"]]})

    def cut(p: Path, data: bytes) -> None:
        with open(p, "r+b") as f:  # in place: readers keep the same inode
            f.truncate(len(data) // 3)

    stop = threading.Event()

    def cut_and_mend() -> None:
        while not stop.is_set():
            for p, data in whole.items():
                cut(p, data)
                time.sleep(0.002)  # how long a file stays cut
                with open(p, "r+b") as f:
                    f.write(data)

    run()
    for p, data in whole.items():
        cut(p, data)
    run()
    cutter = threading.Thread(target=cut_and_mend)
    cutter.start()
    try:
        for _ in range(4):
            run()
    finally:
        stop.set()
        cutter.join()
    print("RESULT " + json.dumps({"phases": phases, "located": located}), flush=True)
    return 0


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.fail("this test mounts a 256 KiB tmpfs (root on Linux, as CI runs)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_is_one_warning_and_no_error(tiny_llama, tmp_path, want, small_disk):
    first, second = prompts()
    out = run_engine(dict(spec(tiny_llama, conn(small_disk.as_uri()), [first, second]),
                          rounds=5), tmp_path, "full")
    assert out["code"] == 0 and [o["tokens"] for o in out["outputs"]] == want * 5
    log = out["log"]
    assert log.count("is failing") == 1  # once the writes failed 3 times in a row
    # no stack of ours, at shutdown or ever (vLLM prints its own chat-template warning)
    assert not [x for x in log.splitlines() if x.strip().startswith("File") and "hurraykv" in x]
    assert out["stats"]["saves_dropped"] >= 1


def test_an_operators_clean_up_is_seen_by_a_running_engine(tiny_llama, tmp_path, want):
    """Segments deleted, the alias log emptied, then the whole directory removed, while one
    engine runs: it stops finding what is gone and stores into a recreated directory."""
    store = tmp_path / "kv"
    eng = Engine(tiny_llama, block_size=BLOCK,
                 connector=conn(store.as_uri(), async_save=False))
    both = list(prompts())
    try:
        generate(eng, both)
        assert generate(eng, both)[1] == [192, 160]
        for p in store.glob("*.hrry"):
            p.unlink()
        (store / "aliases.log").write_bytes(b"")
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == [0, 0]
        assert generate(eng, both)[1] == [192, 160]  # stored again, found again
        for p in store.iterdir():
            p.unlink()
        store.rmdir()
        tokens, cached, _ = generate(eng, both)
        assert tokens == want and cached == [0, 0] and store.is_dir()
        assert generate(eng, both)[1] == [192, 160]
    finally:
        eng.close()


def store_url(kind: str, tmp_path: Path, redis_url: str, stack: contextlib.ExitStack) -> str:
    """A store of ``kind`` for one test: a directory, the session's Redis, or a
    ``hurraykv serve`` of its own (stopped by ``stack``)."""
    if kind == "file":
        return (tmp_path / "kv").as_uri()
    if kind == "redis":
        return redis_url
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True)
    stack.callback(lambda: (server.terminate(), server.wait(10)))
    return f"hurray://{server.stdout.readline().split()[-1]}"


@pytest.fixture(scope="module")
def tp2_plain(tiny_llama, plain_run) -> list[list[int]]:
    """Greedy tokens of a TP=2 engine without a connector."""
    return [o["tokens"] for o in plain_run(tp2_spec(tiny_llama, None))["outputs"]]


def tp2_spec(model: Path, connector: dict | None, rounds: int = 1) -> dict:
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    return spec(model, connector, list(prompts())) | {
        "env": env, "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
        "rounds": rounds}


def tp2(model: Path, connector: dict | None, work: Path, name: str, rounds: int = 1
        ) -> dict:
    """Both prompts through a TP=2 engine, one request at a time, ``rounds`` times."""
    return run_engine(tp2_spec(model, connector, rounds), work, name)


@pytest.mark.parametrize("kind", ["file", "hurray", "redis"])
def test_tensor_parallel_ranks_store_and_reuse(tiny_llama, tmp_path, kind, tp2_plain,
                                               redis_url):
    """TP=2 on CPU (gloo), each rank its own objects (``KEY.tpR``), outputs equal to a TP=2
    engine's without a connector: stored, then reused by the same engine, one request at
    a time (loads ``auto``: sync for a short ``file://`` hit, async for the network
    stores).  ``file://`` is then reused by a fresh engine loading async (a restart reads
    the alias log, where ``.tpR`` keys were dropped): vLLM's output aggregator reports a
    request loaded once both ranks have (``KVOutputAggregator``).  One store engine and
    one reuse engine cover both load modes, so the suite starts 4 TP=2 engines, not 6."""
    with contextlib.ExitStack() as stack:
        url = store_url(kind, tmp_path, redis_url, stack)
        stored = tp2(tiny_llama, conn(url, model_id=f"tp2-{kind}"), tmp_path, "store",
                     rounds=2)
        reused = tp2(tiny_llama, conn(url, model_id=f"tp2-{kind}", load_mode="async"),
                     tmp_path, "reuse") if kind == "file" else None
    outputs = stored["outputs"] + (reused["outputs"] if reused else [])
    assert [o["tokens"] for o in outputs] == tp2_plain * (len(outputs) // 2)
    assert [o["num_cached_tokens"] for o in outputs[2:]] == [192, 160] * (
        len(outputs) // 2 - 1)
    if kind == "file":
        names = sorted(p.name for p in (tmp_path / "kv").glob("*.hrry"))
        assert any(".tp0-" in n for n in names) and any(".tp1-" in n for n in names)


def test_a_worker_that_cannot_read_its_cache_recomputes_what_the_scheduler_matched(
        tiny_llama, tmp_path, want, monkeypatch, tmp_path_factory):
    """A layout the worker refuses at registration: the engine still starts and serves,
    every chunk the scheduler matches is recomputed (never left unwritten)."""
    from hurraykv.adapters import vllm as hv

    store = tmp_path / "kv"
    both = list(prompts())
    stored_both(tmp_path_factory, tiny_llama, store)

    def refuse(*args, **kwargs):
        raise hk_errors.UnsupportedError("a layout this test pretends not to read")

    monkeypatch.setattr(hv.LayerView, "__init__", refuse)
    eng = Engine(tiny_llama, block_size=BLOCK, connector=conn(store.as_uri()))
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        tokens, _, _ = generate(eng, both)
        assert tokens == want
        worker = get_kv_transfer_group()
        assert "cannot be read" in worker.disabled  # the scheduler matched, the worker refused
        # per chunk: the 6 and 5 chunks the scheduler matched for the two prompts
        assert worker.stats["chunks_failed"] == 6 + 5 and worker.stats["chunks_loaded"] == 0
    finally:
        eng.close()


def test_the_connector_logs_through_vllms_format(tiny_llama, tmp_path):
    out = run_engine(spec(tiny_llama, conn((tmp_path / "kv").as_uri()), [prompts()[0]]),
                     tmp_path, "log")
    start = [line for line in out["log"].splitlines() if "HurrayConnector (" in line]
    assert len(start) == 2  # scheduler and worker side, once each
    for line in start:  # vLLM's format: level, date and time, file:line
        assert " INFO " in line and "[connector.py:" in line and str(Path(tmp_path / "kv")) in line
    assert os.environ.get("VLLM_LOGGING_LEVEL", "INFO") == "INFO"


def test_a_segment_of_another_identity_is_never_loaded(tiny_llama, tmp_path, want,
                                                       tmp_path_factory):
    """Same geometry, another model and dtype, under this engine's names: a recompute with
    one line, not KV converted into the engine's blocks."""
    import ml_dtypes
    import numpy as np

    import hurraykv as hk
    from hurraykv.io import checksums

    store = tmp_path / "kv"
    both = list(prompts())
    stored_both(tmp_path_factory, tiny_llama, store)
    for path in store.glob("*.hrry"):
        snap = hk.load_snapshot(path)
        pools = [[snap.tensor(layer, role).page_pool.astype(ml_dtypes.bfloat16)
                  for layer in range(snap.num_layers)] for role in ("key", "value")]
        pages = len(pools[0][0])
        forged = hk.KVCacheSnapshot.from_arrays(pools[0], pools[1], np.arange(pages),
                                                [0, pages], [snap.total_tokens],
                                                model="another/model")
        # as another engine's writer stores it: with checksums (valid ones), so what
        # refuses it is the identity, not the verification
        hk.save_snapshot(checksums.with_checksums(forged), path)
    out = run_engine(spec(tiny_llama, conn(store.as_uri(), "kv_consumer"), both), tmp_path,
                     "load")
    assert [o["tokens"] for o in out["outputs"]] == want
    assert out["stats"]["chunks_failed"] == 6 + 5 and out["stats"]["chunks_loaded"] == 0
    assert out["stats"]["chunks_corrupt"] == 0  # another engine's, not damaged
    assert out["log"].count("is not this engine's") == 2  # one line per request


def test_tenants_with_another_cache_salt_never_share(tiny_llama, tmp_path, want):
    first = prompts()[0]
    eng = Engine(tiny_llama, block_size=BLOCK,
                 connector=conn((tmp_path / "kv").as_uri(), async_save=False))
    try:
        tokens, cached, _ = generate(eng, [first], ["tenant-a"])
        assert tokens == want[:1] and cached == [0]
        assert generate(eng, [first], ["tenant-a"])[1] == [192]  # the same salt shares
        for salt in ("tenant-b", None):  # another tenant, and no tenant, do not
            tokens, cached, _ = generate(eng, [first], [salt])
            assert tokens == want[:1] and cached == [0], salt
    finally:
        eng.close()


def test_lora_adapters_and_prompt_embeddings_are_keyed_apart(tiny_llama, tmp_path):
    """Requests as vLLM's scheduler builds them (``vllm.v1.request.Request``, with a
    ``LoRARequest`` as ``vllm/lora/request.py`` defines it), asked of the running
    scheduler's connector after a plain request stored the prompt."""
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    first = prompts()[0]
    adapters = {}
    for name, byte in (("a", b"\x01"), ("b", b"\x02")):
        adapters[name] = tmp_path / f"adapter-{name}"
        adapters[name].mkdir()
        (adapters[name] / "adapter_model.safetensors").write_bytes(byte * 64)
    eng = Engine(tiny_llama, block_size=BLOCK,
                 connector=conn((tmp_path / "kv").as_uri(), async_save=False))
    try:
        generate(eng, [first])
        sched = eng.core.scheduler.connector
        counter = iter(range(100))

        def matched(tokens=first, **kw) -> int:
            request = Request(f"probe-{next(counter)}", tokens, SamplingParams(max_tokens=1),
                              None, **kw)
            try:
                return ask(sched, request)[0]
            finally:
                sched.request_finished(request, [])

        assert matched() == 192
        assert matched(lora_request=LoRARequest("a", 1, str(adapters["a"]))) == 0
        a, b = (sched.scheduler.state(Request(f"k{n}", first, SamplingParams(max_tokens=1), None,
                                     lora_request=LoRARequest(n, i, str(adapters[n]))))
                for i, n in ((1, "a"), (2, "b")))
        assert set(a.keys.upto(first, 6)).isdisjoint(b.keys.upto(first, 6))
        # prompt embeddings: token ids do not say what was computed; never keyed
        embeds = Request("embeds", None, SamplingParams(max_tokens=1), None,
                         prompt_embeds=torch.zeros(len(first), 128))
        assert ask(sched, embeds) == (0, False)
    finally:
        eng.close()


def _damaged(snap, where: str):
    """A copy of a stored segment, damaged (``pool``: one bit of every value of page 3 of
    layer 1's values, enough to change the tokens when loaded; ``pool0``: the same in
    layer 0's keys; ``table``: two block-table
    entries swapped, still a valid table; ``scale``: layer 0's key scale), keeping the
    checksums written with the original."""
    import ml_dtypes
    import numpy as np

    import hurraykv as hk

    keys = [snap.tensor(layer, "key").page_pool.copy() for layer in range(snap.num_layers)]
    values = [snap.tensor(layer, "value").page_pool.copy() for layer in range(snap.num_layers)]
    table = snap.tensor(0, "key").block_table.astype(np.int64).copy()
    scales = None if snap.kv_scales is None else np.array(snap.kv_scales, np.float32)
    if where == "pool":
        values[1].view(np.uint8).reshape(len(values[1]), -1)[3, 3::4] ^= 0x20  # every value
    elif where == "pool0":  # layer 0: checked in the read itself, not beside the forward
        keys[0].view(np.uint8).reshape(len(keys[0]), -1)[3, 3::4] ^= 0x20
    elif where == "table":
        table[[1, 2]] = table[[2, 1]]
    else:
        scales[0, 0] = np.float32(scales[0, 0]) * np.float32(1.0009765625)
    pages = len(keys[0])
    out = hk.KVCacheSnapshot.from_arrays(
        keys, values, table, [0, pages], snap.seq_lens, kv_scales=scales, model=snap.model,
        element_type="float8_e4m3" if keys[0].dtype == ml_dtypes.float8_e4m3fn else None)
    return out.with_info(metadata=dict(snap.metadata))


@pytest.mark.parametrize(("kind", "where"), [("file", "pool"), ("file", "pool0"),
                                             ("hurray", "pool"), ("redis", "pool"),
                                             ("file", "table"), ("file", "scale")])
def test_a_flipped_stored_byte_is_a_recompute_reported_once(tiny_llama, tmp_path, kind,
                                                            where, redis_url, lines,
                                                            plain_run):
    """Damage in a stored page pool, block table or scale, on every backend: the loading
    engine verifies the checksums written with the segment, recomputes, reports it once,
    takes the object out of the store and stores it again."""
    from hurraykv.chunks.keys import ChunkKeys
    from hurraykv.chunks.urls import open_store

    dtype, kv_cache_dtype = ("bfloat16", "fp8") if where == "scale" else ("float32", "auto")
    if where == "scale":
        skip_unless_cpu_takes(dtype, kv_cache_dtype)
    first, second = prompts()
    reference = [o["tokens"] for o in plain_run(
        spec(tiny_llama, None, [first, second], dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    )["outputs"]]
    with contextlib.ExitStack() as stack:
        url = store_url(kind, tmp_path, redis_url, stack)
        # a model_id of its own: other tests share the session's Redis
        eng = Engine(tiny_llama, block_size=BLOCK, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     connector=conn(url, async_save=False, model_id=f"flip-{kind}-{where}"))
        stack.callback(eng.close)
        log = lines()
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        tokens, cached, _ = generate(eng, [first, second])
        assert tokens == reference and cached == [0, 0]
        keys = ChunkKeys(eng.core.scheduler.connector.seed, BLOCK).upto(first, 6)
        store = open_store(url)
        stack.callback(store.close)
        name = store.locate(keys)[-1]  # the segment of the first prompt's own chunks
        first_chunk = int(name.rsplit("-", 1)[1])
        store.put(keys[first_chunk:], first_chunk, _damaged(store.get(name), where), {})
        # per chunk each request was to load from the damaged segment (both share its
        # first chunks)
        seconds = ChunkKeys(eng.core.scheduler.connector.seed, BLOCK).upto(second, 5)
        corrupt = sum(n == name for n in store.locate(keys + seconds))
        tokens, _, _ = generate(eng, [first, second])
        assert tokens == reference  # not one token from the damaged bytes
        worker = get_kv_transfer_group()
        # the second request met the damaged segment in the same step as the first (its
        # chunks corrupt too), or later, once it was taken out (a miss)
        seen = worker.stats["chunks_corrupt"]
        assert seen in (corrupt - 2, corrupt) and corrupt > 3
        assert log.count("does not match its checksum") == 1
        tokens, cached, _ = generate(eng, [first, second])  # stored again, whole
        assert tokens == reference and cached == [192, 160]
        assert worker.stats["chunks_corrupt"] == seen
