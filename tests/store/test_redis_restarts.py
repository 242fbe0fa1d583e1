"""A Redis that restarts under the page store and the redis:// chunk store (issue 46 item
1): real redis-server processes, killed or shut down and started again on the same port, a
real 3-master cluster with one master restarted, a real server loading its data.  While
Redis is away every call raises ``TransportError`` (never a redis-py exception); once it is
back the next put and get work on the same store object, although Redis lost the scripts
the store loaded when it opened."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hurraykv.chunks.redis import RedisChunks
from hurraykv.errors import TransportError
from hurraykv.store import PageStore
from tests.support.redis_servers import (
    free_cluster_port,
    free_port,
    redis_server_binary,
    start_redis,
)
from tests.support.snapshots import make_snapshot, zeroed


def key(n: int) -> str:
    """A chunk key as the connector makes them: 32 hex digits."""
    return f"{n:032x}"


CLUSTER_NODE = ("--cluster-enabled", "yes", "--cluster-node-timeout", "5000")


class Server:
    """One redis-server on a fixed port that a test stops and starts again."""

    def __init__(self, workdir: Path, port: int, *extra: str) -> None:
        self.workdir, self.port, self.extra = workdir, port, extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = start_redis(redis_server_binary(), self.workdir, self.port, *self.extra)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def shutdown(self) -> None:
        """``SHUTDOWN NOSAVE``: Redis's own way out, its connections closed."""
        assert self.proc is not None
        with contextlib.suppress(redis.ConnectionError):  # the connection it closes
            redis.Redis(port=self.port, retry=Retry(NoBackoff(), 0)).shutdown(nosave=True)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path, free_port())
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Three masters, slots split by redis-cli --cluster create; each restartable (its
    cluster config file keeps its slots across a restart)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("the cluster tests need redis-cli (package redis-tools)")
    root = tmp_path_factory.mktemp("restarted-cluster")
    nodes = []
    try:
        for _ in range(3):
            port = free_cluster_port()
            (root / str(port)).mkdir()
            nodes.append(Server(root / str(port), port, *CLUSTER_NODE))
            nodes[-1].start()
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        wait_cluster_ok(nodes)
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def wait_cluster_ok(nodes: list[Server]) -> None:
    deadline = time.monotonic() + 30
    waiting = nodes
    while waiting:
        waiting = [n for n in waiting if "cluster_state:ok" not in str(
            redis.Redis(port=n.port).execute_command("CLUSTER", "INFO"))]
        if waiting and time.monotonic() > deadline:
            pytest.fail(f"nodes {[n.port for n in waiting]} did not reach cluster_state:ok")
        time.sleep(0.05)


def raises_transport(call: Callable[[], Any], what: str, answer_too: bool = False) -> None:
    """``call`` fails with TransportError (or, ``answer_too``, returns); anything else (a
    redis-py exception, an answer) fails the test naming ``what``."""
    try:
        call()
    except TransportError:
        return
    except Exception as e:
        raise AssertionError(f"{what}: {type(e).__module__}.{type(e).__name__}: {e}") from e
    assert answer_too, f"{what}: no error while Redis was away"


def page_store_calls(store: PageStore) -> dict[str, Callable[[], Any]]:
    snap = make_snapshot(seed=3)
    return {"put": lambda: store.put("down", snap, np.arange(22)),
            "get": lambda: store.get("kept"), "get_layer": lambda: store.get_layer("kept", 0),
            "delete": lambda: store.delete("kept"), "in": lambda: "kept" in store,
            "contains_many": lambda: store.contains_many(["kept"]),
            "lookup_prefix": lambda: store.lookup_prefix(np.arange(22), 4),
            "stats": store.stats, "fsck": store.fsck}


def chunk_store_calls(chunks: RedisChunks, name: str) -> dict[str, Callable[[], Any]]:
    """Every call of the store on segment ``name``, stored before Redis went away."""
    snap = make_snapshot(seed=3)
    return {"put": lambda: chunks.put([key(9)], 0, snap, {"model": "m"}),
            "get": lambda: chunks.get(name), "locate": lambda: chunks.locate([key(1)]),
            "exists": lambda: chunks.exists([name]), "catalog": chunks.catalog,
            "retain": lambda: chunks.retain([name], pin=None, ttl_s=60),
            "remove": lambda: chunks.remove(name), "discard": lambda: chunks.discard(name),
            "connect": chunks.connect}


def works_again(store: PageStore, seed: int) -> None:
    """A put and a get on the store opened before the restart (its scripts lost)."""
    snap = make_snapshot(seed=seed)
    store.put(f"after-{seed}", snap, np.arange(22))
    assert store.get(f"after-{seed}").equal(zeroed(snap))
    assert store.lookup_prefix(np.arange(22), 4)[0] == f"after-{seed}"
    store.delete(f"after-{seed}")


def chunks_work_again(chunks: RedisChunks, seed: int) -> None:
    snap = make_snapshot(seed=seed)
    chunks.put([key(seed), key(seed + 1000)], 0, snap, {"model": "m"})
    name = chunks.locate([key(seed)])[0]
    assert name is not None
    assert chunks.get(name).equal(zeroed(snap).with_info(metadata={"model": "m"}))


# ------------------------------------------------------------------- scripts lost alone
def test_puts_after_script_flush_reload_the_scripts(server):
    """SCRIPT FLUSH empties the script cache as a restart does, the data kept: before,
    every later put failed with NoScriptError."""
    store = PageStore.from_url(f"redis://127.0.0.1:{server.port}")
    snap = make_snapshot(seed=1)
    store.put("kept", snap)
    for seed in (10, 11):  # the direct EVALSHA (swap) and the pipelined ones (addref_many)
        store.client.script_flush()
        works_again(store, seed)
    store.client.script_flush()
    store.delete("kept")  # remove and the release's dropref
    store.client.script_flush()
    assert store.fsck()["manifests"] == 0
    store.client.close()


# ------------------------------------------------------------------- a single server
@pytest.mark.parametrize("how", ["kill", "shutdown"])
def test_page_store_survives_a_redis_restart(server, how):
    store = PageStore.from_url(f"redis://127.0.0.1:{server.port}")
    store.put("kept", make_snapshot(seed=1))
    getattr(server, how)()
    for what, call in page_store_calls(store).items():
        raises_transport(call, what)
    server.start()
    works_again(store, 20)
    works_again(store, 21)
    store.client.close()


def test_chunk_store_survives_a_redis_restart(server):
    chunks = RedisChunks(f"redis://127.0.0.1:{server.port}", timeout=5)
    chunks.put([key(1)], 0, make_snapshot(seed=1), {"model": "m"})
    name = chunks.locate([key(1)])[0]
    server.shutdown()
    for what, call in chunk_store_calls(chunks, name).items():
        raises_transport(call, what)
    server.start()
    chunks_work_again(chunks, 30)
    chunks_work_again(chunks, 31)
    chunks.close()


def test_a_server_over_a_stopped_redis_answers_busy_then_serves_once_it_is_back(server):
    """``hurraykv serve --store redis://``: while Redis is away a push is SERVER_BUSY (try
    again), not INVALID_MESSAGE (the client's message was fine); once back, pushes land."""
    from hurraykv.net.client import KVClient
    from hurraykv.net.messages import ErrorCode, RemoteError
    from hurraykv.net.server import KVServer

    url = f"redis://127.0.0.1:{server.port}"
    with KVServer(listen="127.0.0.1:0", store=url).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("before", make_snapshot(seed=1))
        server.kill()
        with pytest.raises(RemoteError, match="not stored, try again") as e:
            c.push("during", make_snapshot(seed=2))
        assert e.value.code == ErrorCode.SERVER_BUSY
        server.start()
        c.push("after", make_snapshot(seed=3))  # the same server, the same connection
        assert c.pull("after").equal(zeroed(make_snapshot(seed=3)))
    assert "after" in PageStore.from_url(url)


# ------------------------------------------------------------------- a cluster
def test_page_store_and_chunk_store_survive_a_cluster_master_restart(cluster_nodes):
    url = f"redis+cluster://127.0.0.1:{cluster_nodes[0].port}"
    store = PageStore.from_url(url)
    chunks = RedisChunks(url, timeout=5)
    store.put("kept", make_snapshot(seed=1))
    chunks.put([key(1)], 0, make_snapshot(seed=2), {"model": "m"})
    name = chunks.locate([key(1)])[0]
    node = cluster_nodes[1]  # pages spread over every slot: each put meets it
    node.shutdown()
    # calls that reach every node fail; one whose keys live on the masters still up may
    # answer, but never with a redis-py exception
    everywhere = {"put", "get", "get_layer", "delete", "fsck", "chunks put", "chunks get",
                  "chunks catalog"}
    calls = {**page_store_calls(store), **{f"chunks {what}": call for what, call in
                                           chunk_store_calls(chunks, name).items()}}
    for what, call in calls.items():
        raises_transport(call, what, answer_too=what not in everywhere)
    node.start()
    wait_cluster_ok(cluster_nodes)
    works_again(store, 40)
    chunks_work_again(chunks, 41)
    store.client.close()
    chunks.close()


def test_a_cluster_that_is_down_is_a_transport_error(cluster_nodes):
    """CLUSTERDOWN (a slot no master serves: here one taken back with CLUSTER DELSLOTS)
    is redis-py's ClusterDownError, a ResponseError: said as TransportError, and the
    store works again once the slot is served."""
    from redis.cluster import RedisCluster

    from hurraykv.store.scripts import STATS

    url = f"redis+cluster://127.0.0.1:{cluster_nodes[0].port}"
    store = PageStore.from_url(url)
    store.put("kept", make_snapshot(seed=1))
    slot = RedisCluster.keyslot(store.client, STATS)
    owner = store.client.nodes_manager.get_node_from_slot(slot)
    node = redis.Redis(host=owner.host, port=owner.port)
    node.execute_command("CLUSTER", "DELSLOTS", slot)
    try:
        for what in ("stats", "put"):
            with pytest.raises(TransportError, match="not serving") as exc:
                store.stats() if what == "stats" else store.put("down", make_snapshot())
            assert f"cluster 127.0.0.1:{cluster_nodes[0].port}" in str(exc.value), what
    finally:
        node.execute_command("CLUSTER", "ADDSLOTS", slot)
        wait_cluster_ok(cluster_nodes)
    works_again(store, 60)
    store.client.close()


def test_a_connection_redis_closes_mid_read_is_a_transport_error(server):
    """Redis closes a connection whose replies pile up past its output-buffer limit, as a
    restart closes every connection: the raw GET path said StoreError before."""
    from tests.support.snapshots import fused

    store = PageStore.from_url(f"redis://127.0.0.1:{server.port}")
    snap = fused(2, 4)  # 8 MiB of pages in 64 KiB values
    store.put("big", snap)
    # below one 64 KiB reply: closed whatever the client reads ahead (a read window)
    store.client.config_set("client-output-buffer-limit", "normal 32768 32768 0")
    # closed (EOF) or reset (RST, when Redis closes with replies unread): either way
    with pytest.raises(TransportError, match=f"127.0.0.1:{server.port}: the (server closed "
                                             "the connection|connection broke)"):
        store.get("big")
    store.client.config_set("client-output-buffer-limit", "normal 0 0 0")
    assert store.get("big").equal(snap)
    store.client.close()


# ------------------------------------------------------------------- loading
def test_a_redis_loading_its_data_is_a_transport_error(tmp_path):
    """A real server answering LOADING while it reads its RDB file (slowed per key by its
    test setting ``key-load-delay``): redis-py raises BusyLoadingError, a subclass of its
    ConnectionError, which the store says as TransportError on every path.  The client
    retries nothing, so the calls meet the loading instead of waiting it out."""
    port = free_port()
    first = Server(tmp_path, port)
    first.start()
    client = redis.Redis(port=port, retry=Retry(NoBackoff(), 0))
    store = PageStore(client)
    snap = make_snapshot(seed=1)
    store.put("kept", snap)
    for a in range(0, 10_000, 5_000):  # keys for the loading to take its time over
        client.mset({f"fill:{i}": b"x" * 64 for i in range(a, a + 5_000)})
    client.save()
    first.shutdown()
    loading = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--dir", str(tmp_path), "--key-load-delay", "200",
         "--loading-process-events-interval-bytes", "1024"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(port=port, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + 10
        while True:  # until it answers at all: then it is loading (10,000 keys x 200 us)
            try:
                probe.ping()
            except redis.BusyLoadingError:
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.02)
                continue
            pytest.fail("the server answered before loading: nothing tested")
        for what, call in page_store_calls(store).items():
            raises_transport(call, what)
        with pytest.raises(TransportError, match="loading"):
            PageStore(client)  # its scripts load at once
        while True:
            try:
                probe.ping()
                break
            except redis.BusyLoadingError:
                time.sleep(0.05)
        assert store.get("kept").equal(zeroed(snap))  # read back from the RDB file
        works_again(store, 50)
        client.close()
    finally:
        loading.kill()
        loading.wait(10)
