"""Real redis-server processes on loopback ports, started by the test suites themselves
(a single server and a 3-master cluster); used by tests/ and engine_tests/."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def redis_server_binary() -> str:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A port p with p and p + 10000 (the cluster bus) both free; p <= 55535."""
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


def start_redis(binary: str, workdir: Path, port: int, *extra: str) -> subprocess.Popen:
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


@contextlib.contextmanager
def single_server(workdir: Path) -> Iterator[str]:
    proc = start_redis(redis_server_binary(), workdir, free_port())
    try:
        yield f"redis://127.0.0.1:{proc.args[2]}"
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def cluster(workdir: Path) -> Iterator[str]:
    """Three masters on loopback ports, slots split by redis-cli --cluster create."""
    import redis

    binary = redis_server_binary()
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("the cluster tests need redis-cli (package redis-tools)")
    ports = [free_cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            work = workdir / f"node{port}"
            work.mkdir()
            procs.append(start_redis(binary, work, port, "--cluster-enabled", "yes",
                                     "--cluster-config-file", f"nodes-{port}.conf",
                                     "--cluster-node-timeout", "5000"))
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
