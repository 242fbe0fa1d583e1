"""``hurraykv serve --metrics-listen``: Prometheus text at /metrics and /healthz, scraped
over real HTTP from servers started by the tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

import hurraykv as hk
from hurraykv.cli import main
from hurraykv.net import metrics
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from tests.support.metrics import get, one, scrape
from tests.support.snapshots import make_snapshot


def test_metrics_follow_pushes_pulls_evictions_and_errors(tmp_path):
    snaps = [make_snapshot("float16", seed=i) for i in range(3)]
    obj = snaps[0].nbytes
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path), memory_budget=obj + obj // 2,
                  metrics_listen="127.0.0.1:0").run_in_thread() as st:
        before = scrape(st.metrics_address)
        assert one(before, "pushes_total") == 0 and one(before, "pulls_total") == 0
        assert one(before, "errors_total", code="UNKNOWN_TENSOR") == 0
        assert one(before, "memory_budget_bytes") == obj + obj // 2
        assert ("hurraykv_server_persist_budget_bytes", ()) not in before  # unlimited
        with KVClient(st.address) as c:
            c.push("a", snaps[0])
            size = one(scrape(st.metrics_address), "persisted_bytes")
    budget = int(2.5 * size)
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path), persist_budget=budget,
                  memory_budget=obj + obj // 2,
                  metrics_listen="127.0.0.1:0").run_in_thread() as st, \
            KVClient(st.address) as c:
        first = scrape(st.metrics_address)
        assert one(first, "objects", tier="disk") == 1 and one(first, "persisted_bytes") == size
        assert one(first, "persist_budget_bytes") == budget
        assert one(first, "connections") == 1
        c.push("b", snaps[1])
        c.push("c", snaps[2])  # a third file passes the budget: "a" leaves the disk
        assert c.pull("c").equal(c.pull("c"))
        with pytest.raises(hk.RemoteError):
            c.pull("a")
        after = scrape(st.metrics_address)
        assert one(after, "pushes_total") == 2 and one(after, "pulls_total") == 2
        assert one(after, "evictions_total", tier="disk") == 1
        assert one(after, "evictions_total", tier="memory") == 1  # "b" made room for "c"
        assert one(after, "errors_total", code="UNKNOWN_TENSOR") == 1
        assert one(after, "errors_total", code="STORE_FULL") == 0
        assert one(after, "objects", tier="disk") == 2
        assert one(after, "objects", tier="memory") == 1
        assert one(after, "persisted_bytes") == 2 * size <= budget
        assert one(after, "memory_bytes") == obj
        assert one(after, "received_bytes_total") > 2 * obj + one(first, "received_bytes_total")
        assert one(after, "sent_bytes_total") > 2 * obj + one(first, "sent_bytes_total")
        assert one(after, "reserved_bytes") == 0 and one(after, "persist_reserved_bytes") == 0
        s = c.stat()  # STAT tells the same story
        assert (s["pushes"], s["pulls"], s["disk_evictions"], s["memory_evictions"]) == \
            (2, 2, 1, 1)
        assert s["errors"] == {"UNKNOWN_TENSOR": 1}


def test_a_bad_request_is_counted_by_its_code(tmp_path):
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path), persist_budget=8192,
                  metrics_listen="127.0.0.1:0").run_in_thread() as st, \
            KVClient(st.address) as c:
        with pytest.raises(hk.RemoteError):
            c.push("too-big", make_snapshot("float16"))  # its file passes 8 KiB
        samples = scrape(st.metrics_address)
        assert one(samples, "errors_total", code="STORE_FULL") == 1
        assert one(samples, "pushes_total") == 0
        assert one(samples, "evictions_total", tier="disk") == 0


def on_loop(loop, fn) -> None:
    """Run ``fn`` on the server's event loop and wait until it has run (and so has every
    callback queued before it)."""
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (fn(), done.set()))
    assert done.wait(10)


def test_healthz_is_200_while_the_loop_answers_and_503_when_it_does_not(monkeypatch):
    with KVServer(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0").run_in_thread() as st:
        status, body = get(st.metrics_address, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        monkeypatch.setattr(metrics, "HEALTH_TIMEOUT", 0.3)
        stuck = threading.Event()
        st.loop.call_soon_threadsafe(lambda: stuck.wait(10))  # a loop blocked in a call
        try:
            status, body = get(st.metrics_address, "/healthz")
            assert status == 503 and json.loads(body)["status"] == "unresponsive"
            status, _ = get(st.metrics_address, "/metrics")  # scrapes never wait on it
            assert status == 200
        finally:
            stuck.set()
        on_loop(st.loop, lambda: None)  # the blocked call has returned
        assert get(st.metrics_address, "/healthz")[0] == 200
        assert get(st.metrics_address, "/")[0] == 404
        on_loop(st.loop, st.server._server.close)  # no longer listening
        status, body = get(st.metrics_address, "/healthz")
        assert status == 503 and json.loads(body)["status"] == "down"


def test_two_servers_in_one_process_count_apart():
    with KVServer(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0").run_in_thread() as one_, \
            KVServer(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0").run_in_thread() as two:
        with KVClient(one_.address) as c:
            c.push("k", make_snapshot("float16"))
        assert one(scrape(one_.metrics_address), "pushes_total") == 1
        assert one(scrape(two.metrics_address), "pushes_total") == 0
        address = one_.metrics_address
    with pytest.raises(OSError):  # stopping the server stopped its endpoint
        urllib.request.urlopen(f"http://{address}/metrics", timeout=2)


def test_metrics_listen_is_checked():
    with pytest.raises(hk.HurrayError, match="metrics_listen"):
        metrics.parse_metrics_address("localhost")  # no port: 7878 is the server's own
    assert metrics.parse_metrics_address("[::1]:9100") == ("::1", 9100)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--metrics-listen", "nohost"])
    assert exc.value.code == 2


def test_the_library_does_without_prometheus_client():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import hurraykv as hk\n"
            "from hurraykv.net.server import KVServer\n"
            "with KVServer(listen='127.0.0.1:0').run_in_thread():\n"
            "    pass\n"
            "try:\n"
            "    KVServer(listen='127.0.0.1:0', metrics_listen='127.0.0.1:0').run_in_thread()\n"
            "except hk.MissingDependencyError as e:\n"
            "    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "pip install 'hurraykv[metrics]'" in p.stdout and "--metrics-listen" in p.stdout
    p = subprocess.run([sys.executable, "-c", "import sys, hurraykv.net.server, "
                        "hurraykv.cli; assert 'prometheus_client' not in sys.modules"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_cli_serve_with_both_options_and_stat(tmp_path):
    snap = make_snapshot("float16")
    hk.save_snapshot(snap, tmp_path / "in.hrry")
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0", "--persist", str(tmp_path / "store"),
                          "--persist-budget", "200K", "--metrics-listen", "127.0.0.1:0",
                          "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = p.stdout.readline().split()[-1]
        line = p.stdout.readline()
        assert "metrics on http://" in line, p.stderr.read()
        web = line.split("http://")[1].split("/")[0]
        assert "(budget 200.00 KiB)" in p.stdout.readline()

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args],
                                  capture_output=True, text=True, timeout=60)

        for key in ("a", "b"):  # one file is about 113 KiB: the second evicts the first
            r = cli("push", address, key, str(tmp_path / "in.hrry"))
            assert r.returncode == 0, r.stderr
        r = cli("stat", address)
        assert r.returncode == 0, r.stderr
        assert "evictions    : 0 from memory, 1 from disk" in r.stdout
        assert "of 200.00 KiB (--persist-budget)" in r.stdout
        assert "2 pushes, 0 pulls" in r.stdout
        samples = scrape(web)
        assert one(samples, "evictions_total", tier="disk") == 1
        assert one(samples, "persist_budget_bytes") == 200 << 10
        assert get(web, "/healthz")[0] == 200
    finally:
        p.terminate()
        p.wait(10)
