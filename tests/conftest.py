from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI (CI=true) replays a fixed set of examples so a run is reproducible; local runs keep
# exploring new ones.  No deadlines: a loaded 2-core machine is slow, not wrong.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

VECTORS = Path(__file__).parent / "vectors"
# The reference project's golden vectors, vendored so a clone anywhere tests against them;
# SHARED_REFERENCE is the workspace copy they came from (checked equal when present).
REFERENCE = VECTORS / "reference"
SHARED_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not (REFERENCE / "manifest.json").exists():
        pytest.fail(f"reference conformance vectors not found at {REFERENCE}")
    return REFERENCE


def split_stream(data: bytes):
    """Descriptor bytes followed by each buffer's bytes (the streaming form, D8)."""
    from hurraykv.wire.descriptor import decode_descriptor

    desc = decode_descriptor(data)
    pos = len(desc.encode())
    buffers = []
    for h in desc.buffers:
        buffers.append(data[pos:pos + h.byte_size])
        pos += h.byte_size
    return desc, buffers


# ---- real Redis servers, started by the suite ---------------------------------------------
def _redis_server_binary() -> str:
    import os
    import shutil
    import subprocess

    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=False,
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = shutil.which("redis-server")
        if found:
            return found
    pytest.fail("the store tests need a real redis-server (and redis-cli for the cluster): "
                "install the distribution package, e.g. `apt-get install redis-server`")
    raise AssertionError


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_cluster_port() -> int:
    """A port p with p and p + 10000 (the cluster bus) both free; p <= 55535."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    pytest.fail("no free loopback port pair for a Redis Cluster node")
    raise AssertionError


def _start_redis(binary: str, workdir: Path, port: int, *extra: str):
    import subprocess
    import time

    import redis

    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(workdir),
                             "--protected-mode", "no", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None:
                pytest.fail(f"redis-server on port {port} exited with {proc.returncode}")
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"redis-server on port {port} did not answer")
    raise AssertionError


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = _redis_server_binary()
    port = _free_port()
    proc = _start_redis(binary, tmp_path_factory.mktemp("redis"), port)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """Three masters on loopback ports, slots split by redis-cli --cluster create."""
    import shutil
    import subprocess
    import time

    import redis

    binary = _redis_server_binary()
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("the cluster tests need redis-cli (package redis-tools)")
    ports = [_free_cluster_port() for _ in range(3)]
    procs = []
    for port in ports:
        work = tmp_path_factory.mktemp(f"cluster{port}")
        procs.append(_start_redis(binary, work, port, "--cluster-enabled", "yes",
                                  "--cluster-config-file", f"nodes-{port}.conf",
                                  "--cluster-node-timeout", "5000"))
    try:
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        # Every node must see all slots covered before the first command: a node that has
        # not yet heard of the others answers CLUSTERDOWN.
        deadline = time.monotonic() + 60
        waiting = list(ports)
        while waiting:
            waiting = [p for p in waiting if "cluster_state:ok" not in str(
                redis.Redis(port=p).execute_command("CLUSTER", "INFO"))]
            if waiting and time.monotonic() > deadline:
                pytest.fail(f"Redis Cluster nodes {waiting} did not reach cluster_state:ok")
            time.sleep(0.05)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
