"""Issue 46, items 12 and 15: the command line as a newcomer meets it.  ``rm`` removes
every key that exists and names the missing ones; a missing key reads ``no such key``; an
empty key is a usage error; ``ls PREFIX`` takes Redis-style globs; every positional has
help; ``inspect --json`` prints an object for a rejected file as ``validate --json`` does;
an error line names its subject first; ``--version`` is one line; ``python -m hurraykv``
runs; ``cache ls`` says what a ``-`` means.

Calls ``hurraykv.cli.main`` in the test process wherever no real process is needed; one
in-process server is shared by the tests that talk to one."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.keys import ChunkKeys, identity_digest
from hurraykv.chunks.urls import open_store
from hurraykv.cli import build_parser, main
from hurraykv.io import checksums
from hurraykv.net.server import KVServer
from tests.support.snapshots import make_snapshot


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def snap_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("newcomer") / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), path)
    return str(path)


@pytest.fixture(scope="module")
def served():
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        yield st


def push(address: str, snap_file: str, *keys: str) -> None:
    for key in keys:
        assert main(["push", "-q", address, key, snap_file]) == 0


def listed(address: str, capsys, *args: str) -> list[str]:
    capsys.readouterr()
    assert main(["ls", "--json", address, *args]) == 0
    return [k["key"] for k in json.loads(capsys.readouterr().out)["keys"]]


# ------------------------------------------------------------------- 12 rm
def test_rm_removes_every_key_that_exists_and_names_each_missing_one(served, snap_file,
                                                                     capsys):
    push(served.address, snap_file, "rm/k1", "rm/k2")
    capsys.readouterr()
    assert main(["rm", served.address, "rm/k1", "rm/missing", "rm/k2", "rm/gone"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["removed rm/k1", "removed rm/k2"]
    assert err.splitlines() == [
        f"hurraykv: {served.address}: no such key 'rm/missing'",
        f"hurraykv: {served.address}: no such key 'rm/gone'"]
    assert listed(served.address, capsys, "rm/") == []  # k2 too, after the missing one


# ---------------------------------------------------------- 15 a missing key, an empty one
def test_a_missing_key_is_said_without_protocol_jargon(served, tmp_path, capsys):
    assert main(["pull", served.address, "nope", str(tmp_path / "x.hrry")]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"hurraykv: {served.address}: no such key 'nope'")
    assert not (tmp_path / "x.hrry").exists()


@pytest.mark.parametrize("argv", [["push", "{a}", "", "{f}"], ["pull", "{a}", "", "out.hrry"],
                                  ["rm", "{a}", "k", ""]])
def test_an_empty_key_is_a_usage_error_before_the_server_is_asked(served, snap_file, capsys,
                                                                   argv):
    with pytest.raises(SystemExit) as exit_:
        main([a.format(a=served.address, f=snap_file) for a in argv])
    assert exit_.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert f"hurraykv {argv[0]}: argument KEY: key '' (0 bytes): a key is 1 to 4096 UTF-8 " \
           "bytes without NUL" in line, line


# ------------------------------------------------------------------- 15 ls globs
@pytest.mark.parametrize(("pattern", "keys"), [
    ("g/", ["g/a1", "g/a2", "g/b*", "g/bc"]),       # no glob character: a prefix
    ("g/a*", ["g/a1", "g/a2"]),
    ("g/a?", ["g/a1", "g/a2"]),
    ("g/?1", ["g/a1"]),
    ("g/[ab]?", ["g/a1", "g/a2", "g/b*", "g/bc"]),
    ("g/[^a]*", ["g/b*", "g/bc"]),
    ("g/a[1-1]", ["g/a1"]),
    (r"g/b\*", ["g/b*"]),                             # an escaped * is itself
    ("g/*c", ["g/bc"]),                               # a glob matches the whole key
    ("g/x*", []),
])
def test_ls_takes_redis_style_globs(served, snap_file, capsys, pattern, keys):
    if not listed(served.address, capsys, "g/"):
        push(served.address, snap_file, "g/a1", "g/a2", "g/b*", "g/bc", "h/a1")
    assert listed(served.address, capsys, pattern) == keys
    assert main(["ls", served.address, pattern]) == 0
    out = capsys.readouterr().out
    assert f"{len(keys)} key" in out.splitlines()[-1]


def test_ls_aliases_take_the_same_globs(served, snap_file, capsys):
    push(served.address, snap_file, "al/target")
    from hurraykv.net.client import KVClient

    with KVClient(served.address) as client:
        client.link([("al/x1", "al/target"), ("al/y1", "al/target")])
    capsys.readouterr()
    assert main(["ls", "--aliases", "--json", served.address, "al/x*"]) == 0
    assert json.loads(capsys.readouterr().out)["aliases"] == [
        {"alias": "al/x1", "target": "al/target"}]


# ------------------------------------------------------------------- 15 help
def _commands(parser: argparse.ArgumentParser, name: str = "hurraykv"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action.choices, dict):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def test_every_positional_of_every_command_has_help():
    bare = [f"{name} {a.metavar or a.dest}" for name, p in _commands(build_parser())
            for a in p._actions if not a.option_strings and not isinstance(
                a.choices, dict) and not a.help]
    assert bare == []


@pytest.mark.parametrize("command", ["push", "pull", "rm"])
def test_key_help_says_what_a_key_is(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r" KEY (the|keys) .*\(?1 to 4096 UTF-8 bytes", text), text


# ------------------------------------------------------------- 15 inspect --json, errors
def test_inspect_json_prints_an_object_for_a_rejected_file(tmp_path, capsys):
    bad = tmp_path / "bad.hrry"
    bad.write_bytes(b"HRRYFILE" + b"0" * 200)
    assert main(["inspect", "--json", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"path": str(bad), "valid": False, "error": {
        "type": "ContainerError", "field": "container_version_major",
        "message": "container_version_major at byte 8: found 48; this reader supports 1"}}
    assert one_line(err).startswith(f"hurraykv: {bad}: ContainerError: ")
    assert main(["validate", "--json", str(bad)]) == 1
    assert json.loads(capsys.readouterr().out) == json.loads(out)


def test_every_error_line_names_its_subject_first_then_the_error(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros(3))                # message starts with the path
    (tmp_path / "d.bin").write_bytes(b"\x00" * 64)          # message does not
    bad = tmp_path / "bad.hrry"
    bad.write_bytes(b"HRRYFILE" + b"0" * 200)
    for path, error in ((tmp_path / "x.npy", "ContainerError"),
                        (tmp_path / "d.bin", "DescriptorError"), (bad, "ContainerError")):
        for command in ("inspect", "validate"):
            assert main([command, str(path)]) == 1
            line = one_line(capsys.readouterr().err)
            assert line.startswith(f"hurraykv: {path}: {error}: "), line
            assert line.count(str(path)) == 1, line


# ------------------------------------------------------- 15 --version, python -m hurraykv
def test_version_is_one_line_through_a_pipe_and_python_m_hurraykv_runs():
    for argv in (["-m", "hurraykv.cli"], ["-m", "hurraykv"]):
        p = subprocess.run([sys.executable, *argv, "--version"], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, COLUMNS="40"))
        assert p.returncode == 0, p.stderr
        assert p.stdout == (f"hurraykv {hk.__version__} (Hurray descriptor 1.0, .hrry "
                            "container 1.0, interchange protocol 1)\n")


def test_python_m_hurraykv_is_the_command(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hurraykv", "validate", "-"], input=b"",
                       capture_output=True, timeout=60)
    assert p.returncode == 1 and b"hurraykv: <stdin>: " in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "hurraykv", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("usage: hurraykv ")


# ------------------------------------------------------------------- 15 cache ls
def test_cache_ls_says_what_a_dash_means_for_a_store_that_keeps_no_storing_time(
        tmp_path, capsys):
    identity = "model=alpha;cache_dtype=float16"
    store = open_store(f"file://{tmp_path}")
    try:
        pool = np.ones((2, 16, 1, 8), np.float16)
        snap = checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
            [pool], [pool], np.arange(2), [0, 2], [32], model=identity))
        store.put(ChunkKeys(identity_digest(identity), 16).upto(list(range(40)), 2), 0,
                  snap, {})
    finally:
        store.close()
    assert main(["cache", "ls", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if identity in line)
    assert re.search(r"\s-\s+\d+ s ago\s", row), row  # OLDEST unknown, LAST USE known
    assert out.splitlines()[-1] == ("-: not recorded by this store (file:// keeps each "
                                    "segment's last use, its modification time, not when "
                                    "it was stored; a hurray:// server keeps neither)"), out


@pytest.mark.parametrize("argv", [
    ["serve", "--read-timeout", "３０"], ["serve", "--idle-timeout", "٣"],
    ["serve", "--max-connections", "１２"], ["serve", "--listen", "127.0.0.1:８０"],
    ["cache", "ls", "file:///tmp/x", "--timeout", "１"],
    ["cache", "pin", "file:///tmp/x", "k", "--ttl", "６０"]])
def test_numbers_on_the_command_line_are_ascii_digits(argv, capsys):
    """int() and float() read any script's digits ('１２' is 12): a number an operator did
    not type on purpose is a usage error, as the connector's config refuses it."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)  # parsed only: nothing starts, whatever it reads
    assert e.value.code == 2
    assert argv[-1] in capsys.readouterr().err  # the value named


def test_a_thread_count_that_is_no_ascii_number_is_ignored(monkeypatch):
    from hurraykv import threads

    cores = max(1, min(len(os.sched_getaffinity(0)), 8))  # what the cores give
    monkeypatch.setenv("HURRAYKV_THREADS", "²")  # isdigit() says yes, int() raises
    assert threads.workers() == cores
    monkeypatch.setenv("HURRAYKV_THREADS", str(cores + 1))  # a count given is taken
    assert threads.workers() == cores + 1
    monkeypatch.setenv("HURRAYKV_THREADS", "3")
    assert threads.workers() == 3
