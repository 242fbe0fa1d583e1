"""Issue 33, items 5 and 7-10: the command line and ``hurraykv serve`` as a newcomer meets
them.  Start-up mistakes are one line naming the option and the value (exit 2), a closed
pipe is a quiet exit, ``-`` is standard output for the .hrry files ``compact`` and
``pull`` write, ``--json`` on ``ls``, ``stat`` and ``validate``, ``-q``, usage errors
exit 2 with "did you mean", an HTTP peer is named as such, an oversize push is refused
before it is sent, ``ls`` shows one size per key across a restart, rates scale and
counts agree with their nouns; ``serve`` prints each start-up line once, says what it
held at SIGTERM, and its /metrics has process_*, the version and latency histograms.

Calls ``hurraykv.cli.main`` in the test process wherever no real process is needed; one
in-process server is shared by the tests that talk to one."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv import units
from hurraykv.cli import CLOSED_PIPE, main
from hurraykv.errors import ConfigError, TransportError, did_you_mean
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer
from tests.support.certs import PKI
from tests.support.metrics import scrape
from tests.support.snapshots import fused, make_snapshot

MIB = 1 << 20


def one_line(err: str) -> str:
    """The single line a failure printed (no traceback, no empty ``hurraykv: :``)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "hurraykv: : " not in err
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("issue33")
    snap = make_snapshot("int8")
    hk.save_snapshot(snap, d / "s.hrry")
    hk.save_snapshot(snap, d / "plain.hrry", checksums=False)
    hk.save_snapshot(fused(1, 2, seed=1), d / "big.hrry")  # 2 MiB: over the budget below
    (d / "empty.pem").write_bytes(b"")
    (d / "text.pem").write_text("not a certificate\n")
    (d / "a-file").write_text("x")
    pki = PKI(d)
    cert, key = pki.pair("server")
    (d / "other").mkdir()
    other_key = PKI(d / "other").pair("server")[1]  # another key of the same kind
    return {"dir": str(d), "s": str(d / "s.hrry"), "plain": str(d / "plain.hrry"),
            "big": str(d / "big.hrry"), "empty": str(d / "empty.pem"),
            "text": str(d / "text.pem"), "file": str(d / "a-file"), "cert": cert,
            "key": key, "other_key": other_key, "ca": pki.ca_pem}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the tests that talk to one: a 1 MiB memory budget, persisted, with
    a metrics port."""
    d = tmp_path_factory.mktemp("served")
    with KVServer(listen="127.0.0.1:0", memory_budget=MIB, persist=str(d),
                  metrics_listen="127.0.0.1:0").run_in_thread() as st:
        yield st


# ----------------------------------------------------------- 7 start-up mistakes
@pytest.mark.parametrize(("args", "said"), [
    (["--store", "http://127.0.0.1:6379"],
     "--store http://127.0.0.1:6379: scheme 'http://' is not a Redis store; use "
     "redis://HOST:PORT or redis+cluster://HOST:PORT"),
    (["--store", "redis://127.0.0.1:1"], "--store redis://127.0.0.1:1: cannot reach it"),
    (["--persist", "/proc/nope"], "--persist /proc/nope: cannot create it: "),
    (["--persist", "{file}"], "--persist {file}: not a directory"),
    (["--persist", "{file}/sub"], "--persist {file}/sub: cannot create it: Not a directory"),
    (["--tls-cert", "{dir}/missing.pem", "--tls-key", "{key}"],
     "--tls-cert {dir}/missing.pem: cannot read: No such file or directory"),
    (["--tls-cert", "{empty}", "--tls-key", "{key}"],
     "--tls-cert {empty}: the file is empty; it must hold a PEM certificate"),
    (["--tls-cert", "{text}", "--tls-key", "{key}"],
     "--tls-cert {text}: not a PEM certificate (no '-----BEGIN CERTIFICATE-----' line"),
    (["--tls-cert", "{cert}", "--tls-key", "{empty}"],
     "--tls-key {empty}: the file is empty; it must hold a PEM private key"),
    (["--tls-cert", "{cert}", "--tls-key", "{other_key}"],
     "--tls-cert {cert} and --tls-key {other_key}: the key is not the certificate's"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{text}"],
     "--tls-ca {text}: not PEM CA certificates"),
    (["--tls-ca", "{ca}"], "--tls-ca {ca}: the server has no certificate of its own"),
])
def test_serve_start_up_mistakes_are_one_line_naming_the_option(files, capsys, args, said):
    argv = [a.format(**files) for a in args]
    assert main(["serve", "--listen", "127.0.0.1:0", *argv]) == 2
    assert said.format(**files) in one_line(capsys.readouterr().err)


def test_serve_on_an_address_in_use_names_listen(served, capsys):
    assert main(["serve", "--listen", served.address]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--listen {served.address}: cannot listen: Address already in use" in line


def test_serve_whose_metrics_port_is_taken_never_says_it_listens(served, capsys):
    # it said "listening on ..." first, then exited 2: a script took it for started
    assert main(["serve", "--listen", "127.0.0.1:0", "--metrics-listen",
                 served.address]) == 2
    out, err = capsys.readouterr()
    assert "listening" not in out + err
    assert f"--metrics-listen {served.address}: cannot listen: Address already in use" in \
        one_line(err)


def test_a_socket_path_that_is_not_there_is_said_as_such(tmp_path, served, capsys):
    assert main(["stat", str(tmp_path / "nosock.sock")]) == 2  # was "connection refused"
    assert "nosock.sock: no such socket: is `hurraykv serve --listen PATH` running?" in \
        one_line(capsys.readouterr().err)
    assert main(["ls", "--aliases", served.address, "nothing-here/"]) == 0
    assert capsys.readouterr().out.strip() == "0 aliases"  # no "`rm` removes one"


def test_the_page_store_raises_hurray_errors_for_a_bad_or_unreachable_url():
    from hurraykv.store import PageStore

    with pytest.raises(ConfigError, match=r"'http://x:1'.*redis://HOST:PORT") as bad:
        PageStore.from_url("http://x:1")
    assert isinstance(bad.value, hk.HurrayError) and isinstance(bad.value, ValueError)
    with pytest.raises(ConfigError, match="no scheme"):
        PageStore.from_url("localhost:6379")
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:1: cannot reach it"):
        PageStore.from_url("redis://127.0.0.1:1")
    with pytest.raises(TransportError, match="cannot reach it"):
        PageStore.from_url("redis+cluster://127.0.0.1:1")


def test_a_page_store_that_goes_away_midway_is_a_transport_error(tmp_path):
    # before: redis-py's own ConnectionError, though every rejection is a HurrayError
    from hurraykv.store import PageStore
    from tests.support.redis_servers import free_port, redis_server_binary, start_redis

    proc = start_redis(redis_server_binary(), tmp_path, free_port())
    try:
        store = PageStore.from_url(f"redis://127.0.0.1:{proc.args[2]}")
        store.put("a", make_snapshot("int8"))
    finally:
        proc.terminate()
        proc.wait(10)
    for call in (lambda: store.get("a"), lambda: store.put("b", make_snapshot("int8")),
                 store.stats, lambda: store.delete("a")):
        with pytest.raises(TransportError, match=r"127\.0\.0\.1:\d+: cannot reach it"):
            call()


def test_an_address_that_cannot_be_used_is_a_config_error():
    from hurraykv.net.server import parse_address

    for bad in ("http://h:1", ":99999", "ftp://h:1"):
        with pytest.raises(ConfigError, match=re.escape(repr(bad))):
            parse_address(bad)
    with pytest.raises(ConfigError):  # the library's client, as the command line
        KVClient("http://127.0.0.1:1")


@pytest.mark.parametrize(("args", "said"), [
    (["--tls-ca", "{dir}/missing.pem"], "--tls-ca {dir}/missing.pem: cannot read"),
    (["--tls-ca", "{empty}"], "--tls-ca {empty}: the file is empty"),
    (["--tls-ca", "{ca}", "--tls-cert", "{text}", "--tls-key", "{key}"],
     "--tls-cert {text}: not a PEM certificate"),
    (["--tls-key", "{key}"], "--tls-key {key}: the key of no certificate: give --tls-cert"),
])
def test_client_tls_files_are_checked_before_connecting(files, capsys, args, said):
    # nothing listens on port 1: the files are refused before any connection is tried
    assert main(["ls", "127.0.0.1:1", *[a.format(**files) for a in args]]) == 2
    assert said.format(**files) in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------- 8 usage errors
@pytest.mark.parametrize(("argv", "said"), [
    (["serve", "--listen", ":99999"],
     "argument --listen: address ':99999': port '99999' is out of range: a port is 0..65535"),
    (["serve", "--listen", ":http"],
     "argument --listen: address ':http': port 'http' is not a number: a port is 0..65535"),
    (["push", "http://127.0.0.1:7878", "k", "f.hrry"],
     "argument ADDRESS: address 'http://127.0.0.1:7878': hurraykv serve speaks the "
     "Hurray protocol over TCP, not HTTP; give HOST:PORT, e.g. 127.0.0.1:7878"),
    (["serve", "--memory-budget", "-5G"], "argument --memory-budget: '-5G': a size must be > 0"),
    (["serve", "--max-message-size", "-1"],
     "argument --max-message-size: '-1': a size must be > 0"),
    (["serve", "--read-timeout", "-.5"], "argument --read-timeout: '-.5': seconds must be > 0"),
    (["inspct", "x.hrry"], "invalid choice: 'inspct' (choose from 'inspect', "),
    (["inspct", "x.hrry"], "; did you mean 'inspect'?"),
    (["cache", "lss", "file:///tmp"], "; did you mean 'ls'?"),
    (["serve", "--log-level", "inof"], "; did you mean 'info'?"),
    (["inspect", "--sqes", "x.hrry"], "hurraykv inspect: unrecognized arguments: --sqes; did "
     "you mean '--seqs'? (see `hurraykv inspect --help`)"),
    (["cache", "ls", "--segmnts", "file:///tmp"], "hurraykv cache ls: unrecognized "
     "arguments: --segmnts; did you mean '--segments'?"),
    ([], "hurraykv: the following arguments are required: COMMAND (see `hurraykv --help`)"),
])
def test_usage_errors_exit_2_naming_the_option_value_and_rule(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err  # one line: not the usage block


def test_a_cache_url_of_no_store_is_a_usage_error(capsys):
    assert main(["cache", "ls", "http://127.0.0.1:1"]) == 2  # was 1: "data rejected"
    assert "url 'http://127.0.0.1:1': scheme 'http' is not one of" in one_line(
        capsys.readouterr().err)


def test_did_you_mean_only_for_a_close_name():
    assert did_you_mean("lod_mode", ["load_mode", "url"]) == "; did you mean 'load_mode'?"
    assert did_you_mean("zzz", ["load_mode", "url"]) == ""


def test_a_closed_stdout_is_a_quiet_exit_in_process(files, monkeypatch, capsys):
    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["inspect", files["s"]]) == CLOSED_PIPE == 141
    assert capsys.readouterr().err == ""


def test_inspect_into_head_exits_141_without_a_word(files, tmp_path):
    many = tmp_path / "many.hrry"  # --json of 400 members: far more than a pipe holds
    hk.save_snapshot(make_snapshot("float16", layers=200), many)
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "inspect", "--json",
                          str(many)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"{\n"
    p.stdout.close()  # as `| head -1` does
    assert p.wait(60) == CLOSED_PIPE
    assert p.stderr.read() == b""  # before: "hurraykv: ...: Broken pipe", exit 2


def test_compact_to_stdout_writes_the_file_there_and_the_summary_to_stderr(
        files, capsysbinary, tmp_path):
    assert main(["compact", files["s"], "-"]) == 0
    out, err = capsysbinary.readouterr()
    (tmp_path / "c.hrry").write_bytes(out)
    assert hk.load_snapshot(tmp_path / "c.hrry").equal(hk.load_snapshot(files["s"]).compact())
    assert err.decode().startswith("<stdout>: 42 of 54 pages kept")
    assert not (Path.cwd() / "-").exists()  # before: a file named "-"
    assert main(["compact", "-q", files["s"], "-"]) == 0
    out, err = capsysbinary.readouterr()
    assert out.startswith(b"HRRYFILE") and err == b""


def test_a_binary_file_is_not_written_to_a_terminal(files, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["compact", files["s"], "-"]) == 2
    assert "refusing to write a binary .hrry file to a terminal" in one_line(
        capsys.readouterr().err)


def test_pull_to_stdout_and_quiet_push(served, files, capsysbinary, tmp_path):
    assert main(["push", "-q", served.address, "pulled", files["s"]]) == 0
    assert capsysbinary.readouterr() == (b"", b"")  # -q: no summary line either
    assert main(["pull", served.address, "pulled", "-"]) == 0
    out, err = capsysbinary.readouterr()
    (tmp_path / "p.hrry").write_bytes(out)
    assert hk.load_snapshot(tmp_path / "p.hrry").equal(hk.load_snapshot(files["s"]))
    assert err.decode().startswith("pulled pulled: ") and "-> <stdout>" in err.decode()
    assert main(["rm", "-q", served.address, "pulled"]) == 0
    assert capsysbinary.readouterr() == (b"", b"")


def test_json_on_ls_stat_and_validate(served, files, capsys):
    assert main(["push", served.address, "j/one", files["s"]]) == 0
    capsys.readouterr()
    assert main(["ls", "--json", served.address, "j/"]) == 0
    nbytes = hk.load_snapshot(files["s"]).nbytes
    assert json.loads(capsys.readouterr().out) == {
        "address": served.address, "prefix": "j/", "count": 1, "bytes": nbytes,
        "keys": [{"key": "j/one", "bytes": nbytes}]}
    assert main(["stat", "--json", served.address]) == 0
    stat = json.loads(capsys.readouterr().out)
    assert stat["memory_budget"] == MIB and stat["objects_in_memory"] >= 1
    assert main(["validate", "--json", files["s"]]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "path": files["s"], "valid": True, "kind": "hrry", "snapshot": True,
        "checksums": "verified", "summary": f"{files['s']}: valid hrry, "
        f"{hk.load_snapshot(files['s'])!r} (every stored value matches its checksum)"}
    assert main(["validate", "--json", files["text"]]) == 1
    out, err = capsys.readouterr()
    verdict = json.loads(out)
    assert verdict["valid"] is False and verdict["error"]["type"] == "DescriptorError"
    assert "DescriptorError" in one_line(err)  # the usual line too
    assert main(["validate", "-q", files["s"]]) == 0
    assert capsys.readouterr() == ("", "")


# -------------------------------------------------------------------- 5 checksums
def test_validate_without_checksums_says_how_to_get_them(files, capsys):
    assert main(["validate", files["plain"]]) == 0
    assert ("(no checksums: values not verified; save_snapshot writes them by default "
            "(checksums=True to insist, up to about 65,000 pages))") in capsys.readouterr().out


def test_inspect_counts_the_checksums_instead_of_printing_them(files, capsys):
    # save_snapshot's default wrote 16 hex digits a page into the metadata line
    from hurraykv.io import checksums

    n = len(hk.load_snapshot(files["s"]).metadata[checksums.KEY]) // 16
    assert main(["inspect", files["s"]]) == 0
    out = capsys.readouterr().out
    assert f"checksums   : xxh3-64 of {n} pieces (pages and buffers); `hurraykv validate` " \
           "checks them" in out
    assert not re.search(r"[0-9a-f]{32}", out), out
    assert main(["inspect", files["plain"]]) == 0
    assert "checksums" not in capsys.readouterr().out


# ----------------------------------------------- 9 transfers: HTTP, oversize, sizes
def test_the_metrics_port_is_named_as_an_http_peer(served, capsys):
    with pytest.raises(TransportError, match=r"answered in HTTP, not the Hurray protocol: "
                                             r"is it the metrics port \(--metrics-listen\)"):
        KVClient(served.metrics_address, timeout=10)
    assert main(["stat", served.metrics_address]) == 2
    assert "answered in HTTP" in one_line(capsys.readouterr().err)


def test_an_oversize_push_is_refused_before_a_byte_is_sent(served, files, capsys):
    big = hk.load_snapshot(files["big"])
    received = served.server.counts.bytes_received
    assert main(["push", served.address, "big", files["big"]]) == 1
    line = one_line(capsys.readouterr().err)
    assert f"'big' needs {big.nbytes} bytes (2.00 MiB) but the server's --memory-budget " \
           f"is {MIB} bytes (1.00 MiB): refused before sending" in line and "STORE_FULL" in line
    # the handshake and a STAT went, not the 2 MiB: before, it ran to 100% first
    assert served.server.counts.bytes_received - received < 4096


@pytest.mark.parametrize(("stat", "said"), [
    ({"memory_budget": None, "persist_budget": 999}, "--persist-budget is 999 bytes"),
    ({"memory_budget": 10 ** 9, "max_bytes_per_tenant": 999},
     "--max-bytes-per-tenant is 999 bytes"),
])
def test_room_is_checked_against_every_budget_the_stat_shows(stat, said, monkeypatch):
    client = KVClient.__new__(KVClient)
    monkeypatch.setattr(client, "stat", lambda: stat, raising=False)
    with pytest.raises(hk.RemoteError, match=said) as refused:
        client.check_room("k", 1000)
    assert refused.value.code == 0xF1  # STORE_FULL, as the server would answer
    client.check_room("k", 999)  # may fit: left to the server


def test_ls_shows_one_size_per_key_before_and_after_a_restart(tmp_path, files, capsys):
    nbytes = hk.load_snapshot(files["s"]).nbytes

    def listed() -> str:
        with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
            if not any(tmp_path.glob("*.hrry")):
                assert main(["push", st.address, "k", files["s"]]) == 0
            assert main(["ls", st.address]) == 0
            return capsys.readouterr().out.splitlines()[-2]

    before, after = listed(), listed()  # after: served from the file, as read at start
    assert before == after == f"k  {units.size(nbytes):>12}"  # before: 64 KiB more after
    assert "the same before and after a restart" in " ".join(
        subprocess.run([sys.executable, "-m", "hurraykv.cli", "ls", "--help"],
                       capture_output=True, text=True, timeout=60).stdout.split())


def test_rates_scale_and_counts_agree_with_their_nouns(served, files, capsys):
    assert units.rate(512, 1.0) == "512 bytes/s"
    assert units.rate(3 << 20, 2.0) == "1.50 MiB/s"
    assert units.rate(5 << 30, 2.0) == "2.50 GiB/s"
    assert [units.plural(n, "key") for n in (0, 1, 2, 1234)] == [
        "0 keys", "1 key", "2 keys", "1,234 keys"]
    assert units.plural(1, "push") == "1 push" and units.plural(2, "push") == "2 pushes"
    assert main(["push", served.address, "rate/one", files["s"]]) == 0
    said = capsys.readouterr().out
    assert "GiB/s" not in said and "/s)" in said  # before: "(0.00 GiB/s)"
    assert main(["ls", served.address, "rate/"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1 key, ")


# --------------------------------------------------------- 10 serve: lines, metrics
def test_serve_says_each_line_once_stops_on_sigterm_and_has_full_metrics(tmp_path, files):
    p = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                          "127.0.0.1:0", "--persist", str(tmp_path), "--metrics-listen",
                          "127.0.0.1:0", "--log-level", "info"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
        assert first.startswith("hurraykv serve: listening on ")
        address = first.split()[-1]
        web = p.stdout.readline().split("http://")[1].split("/")[0]
        summary = p.stdout.readline()
        assert "memory budget unlimited" in summary and "holding 0 objects" in summary
        snap = hk.load_snapshot(files["s"])
        client = KVClient(address)
        client.push("k", snap)
        client.pull("k")
        client.list_keys()
        samples = scrape(web)
        assert samples[("process_resident_memory_bytes", ())] > 0
        assert ("process_cpu_seconds_total", ()) in samples
        assert samples[("process_open_fds", ())] > 0
        from hurraykv import __version__
        assert samples[("hurraykv_build_info", (("protocol", "1"),
                                                 ("version", __version__)))] == 1
        for request in ("push", "pull", "list"):
            count = ("hurraykv_server_request_duration_seconds_count",
                     (("request", request),))
            inf = ("hurraykv_server_request_duration_seconds_bucket",
                   (("le", "+Inf"), ("request", request)))
            assert samples[count] == samples[inf] == 1, request
        assert samples[("hurraykv_server_request_duration_seconds_bucket",
                        (("le", "0.0005"), ("request", "delete")))] == 0
        p.send_signal(signal.SIGTERM)  # a client still connected
        out, err = p.communicate(timeout=30)
        client.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 0 and "Traceback" not in err
    stopped = out.strip().splitlines()[-1]
    assert stopped.startswith("hurraykv serve: stopped after ")
    assert ("closed 1 client connection; held 1 object (" in stopped
            and f"in {tmp_path} (the files kept for the next start)" in stopped
            and "1 push, 1 pull served" in stopped), stopped
    for line in ("listening on", "metrics on"):  # printed once: not logged as well
        assert line not in err, err
    assert "put key='k'" in err  # the log itself still goes to stderr
