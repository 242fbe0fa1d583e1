"""Regression tests for issue 46 (outside campaign against f2a53bb) on the connections of
a real ``hurraykv serve``: one mutual-TLS tenant can no longer hold every
``--max-connections`` slot (item 6), and a server on a Unix socket removes its socket file
when it stops, takes over a stale one, and never removes a file that is not a socket nor
a live server's socket (item 15).  Each test failed on the code before its fix."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hurraykv.cli import main
from hurraykv.errors import ConfigError, RemoteError, TransportError
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode as E
from hurraykv.net.server import KVServer, ServerConfig
from tests.support.certs import PKI, name
from tests.support.snapshots import make_snapshot, zeroed


# ------------------------------------------------------- 6 a tenant's share of connections
@pytest.fixture
def pki(tmp_path) -> PKI:
    return PKI(tmp_path)


def _tls_server(pki: PKI, **kw) -> KVServer:
    cert, key = pki.pair("server")
    return KVServer(listen="127.0.0.1:0", tls_cert=cert, tls_key=key, tls_ca=pki.ca_pem,
                    **kw)


def _tenant(pki: PKI, label: str):
    cert, key = pki.client(label, name(("CN", label)))
    return lambda address: KVClient(address, tls_cert=cert, tls_key=key,
                                    tls_ca=pki.ca_pem, timeout=10)


def test_one_tenant_cannot_hold_every_connection(pki):
    """Tenant A opens idle connections until refused: it gets its share (a quarter of
    --max-connections by default), and tenant B still connects and works."""
    a, b = _tenant(pki, "tenant-a"), _tenant(pki, "tenant-b")
    held: list[KVClient] = []
    with _tls_server(pki, max_connections=8).run_in_thread() as st:
        try:
            with pytest.raises(RemoteError) as exc:
                for _ in range(8):  # before: all 8 slots were A's
                    held.append(a(st.address))
            assert len(held) == 2
            e = exc.value
            assert e.code == E.SERVER_BUSY, str(e)
            assert "--max-connections-per-tenant" in str(e) and "2" in str(e), str(e)
            snap = make_snapshot(seed=5)
            with b(st.address) as other:
                other.push("k", snap)
                assert other.pull("k").equal(zeroed(snap))
                assert other.stat()["max_connections_per_tenant"] == 2
            assert held[0].ping() >= 0  # A's own connections carry on
        finally:
            for c in held:
                c.close()


def test_connections_that_never_say_hello_hold_no_other_tenants_slot(pki):
    """Tenant A completes TLS handshakes and sends nothing: past its share those take no
    slot of --max-connections (B still connects), and every one is closed after
    --read-timeout, not --idle-timeout."""
    import ssl
    import time

    cert, key = pki.client("tenant-a", name(("CN", "tenant-a")))
    ctx = ssl.create_default_context(cafile=pki.ca_pem)
    ctx.load_cert_chain(cert, key)
    ctx.check_hostname = False
    b = _tenant(pki, "tenant-b")
    with _tls_server(pki, max_connections=8, read_timeout=2.0).run_in_thread() as st:
        host, port = st.address.rsplit(":", 1)
        silent = []
        try:
            for _ in range(8):  # before: all 8 slots A's until --idle-timeout
                raw = socket.create_connection((host, int(port)), timeout=10)
                silent.append(ctx.wrap_socket(raw))
            with b(st.address) as other:
                assert other.ping() >= 0
            started = time.monotonic()
            for s in silent:  # closed by the server: end of stream, no hello answered
                assert s.recv(1) == b""
            assert time.monotonic() - started < 10
        finally:
            for s in silent:
                s.close()


def test_the_share_is_the_setting_given(pki):
    a = _tenant(pki, "tenant-a")
    with _tls_server(pki, max_connections=8, max_connections_per_tenant=3).run_in_thread() \
            as st:
        held = [a(st.address) for _ in range(3)]
        try:
            with pytest.raises(RemoteError, match=r"at most 3 .*per tenant") as exc:
                a(st.address)
            assert exc.value.code == E.SERVER_BUSY
        finally:
            for c in held:
                c.close()
        with a(st.address) as again:  # a closed connection gives its slot back
            assert again.ping() >= 0


@pytest.mark.parametrize(("kw", "rule"), [
    ({"max_connections_per_tenant": 0}, "at least 1"),
    ({"max_connections_per_tenant": -3}, "at least 1"),
    ({"max_connections_per_tenant": True}, "an integer"),
    ({"max_connections_per_tenant": 2.5}, "an integer"),
    ({"max_connections_per_tenant": 9, "max_connections": 8}, "at most --max-connections"),
    ({"max_connections": 0}, "at least 1"),
])
def test_the_config_refuses_nonsense_shares_naming_the_option(kw, rule):
    with pytest.raises(ConfigError, match=rule) as exc:
        ServerConfig(**kw)
    e = exc.value
    option = next(iter(kw)) if "max_connections_per_tenant" not in kw \
        else "max_connections_per_tenant"
    assert e.field == option and e.value == kw[option] and e.rule
    assert "--" + option.replace("_", "-") in str(e)


def test_a_share_without_tenants_is_refused():
    with pytest.raises(ConfigError, match=r"--max-connections-per-tenant 2: .*no --tls-ca") \
            as exc:
        KVServer(listen="127.0.0.1:0", max_connections_per_tenant=2)
    assert exc.value.field == "max_connections_per_tenant"


def test_serve_says_a_bad_share_in_one_line(capsys):
    assert main(["serve", "--listen", "127.0.0.1:0", "--max-connections", "4",
                 "--max-connections-per-tenant", "5"]) == 2
    err = capsys.readouterr().err
    assert "--max-connections-per-tenant" in err and "5" in err, err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------- 15 the Unix socket file
@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory: a Unix socket path is at most 107 bytes, and pytest's tmp_path
    can be longer."""
    with tempfile.TemporaryDirectory(prefix="hk", dir="/tmp") as d:
        yield Path(d)


def _interruptible() -> None:
    """In the child: Ctrl-C's signal as a terminal delivers it, whatever the test run
    inherited (a suite started in the background by a non-interactive shell ignores
    SIGINT, and a Python started so keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _serve_unix(path: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          str(path), "--log-level", "warning"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    line = p.stdout.readline()
    if "listening on" not in line:
        p.kill()
        raise AssertionError(line + p.communicate(timeout=20)[1])
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_server_removes_its_socket_file(sock_dir, sig):
    path = sock_dir / "kv.sock"
    p = _serve_unix(path)
    try:
        with KVClient(str(path), timeout=10) as c:
            assert c.ping() >= 0
    finally:
        p.send_signal(sig)
        out, err = p.communicate(timeout=20)
    assert p.returncode == 0 and "stopped after" in out, out + err
    assert not path.exists()  # before: the socket file stayed


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on: what a killed server leaves."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_a_stale_socket_file_is_taken_over_and_removed_at_stop(sock_dir):
    path = sock_dir / "kv.sock"
    _stale_socket(path)
    with KVServer(listen=str(path)).run_in_thread() as st, KVClient(st.address) as c:
        assert c.ping() >= 0
    assert not path.exists()


def test_a_file_that_is_not_a_socket_is_never_removed(sock_dir):
    path = sock_dir / "kv.sock"
    path.write_text("precious")
    with pytest.raises(TransportError, match="not a socket") as exc:
        KVServer(listen=str(path)).run_in_thread()  # before: the file was deleted
    assert exc.value.field == "listen" and str(path) in str(exc.value)
    assert path.read_text() == "precious"
    os.symlink(sock_dir / "elsewhere", sock_dir / "link.sock")
    with pytest.raises(TransportError, match="not a socket"):
        KVServer(listen=str(sock_dir / "link.sock")).run_in_thread()
    assert os.path.islink(sock_dir / "link.sock")


def test_a_live_servers_socket_is_not_taken_over(sock_dir):
    path = sock_dir / "kv.sock"
    with KVServer(listen=str(path)).run_in_thread() as first:
        with pytest.raises(TransportError, match="a server answers on it") as exc:
            KVServer(listen=str(path)).run_in_thread()  # before: it took the path over
        assert exc.value.field == "listen"
        with KVClient(str(path), timeout=10) as c:
            c.push("k", make_snapshot(seed=6))
        assert dict(first.server.store.listing()).keys() == {"k"}  # the first answered
    assert not path.exists()
