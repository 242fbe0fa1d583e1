"""Regression tests for issue 19 (outside reliability campaign): outputs NumPy cannot
shape, stale temporaries of killed saves, temporaries created through planted symlinks;
and issue 10's: absurd dimensions on every path, temporaries of failed and killed saves.
Each test failed on the code before its fix."""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.io.atomic import temp_pattern
from hurraykv.io.hrry import HrryFile, write_hrry
from hurraykv.io.stream import write_tensor
from hurraykv.net.server import KVServer
from hurraykv.snapshot import group_head, seq_lens_member
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.layouts import BlockPaged
from tests.support.snapshots import make_snapshot, saving_forever


# ------------------------------------------------------------------- 12 output shapes
def _tensor(shape):
    layout = BlockPaged(page_size=1, num_pages=0, num_seqs=1, kv_role=0, layer_index=0,
                        index_type=0)
    desc = hk.TensorDescriptor(0x01, shape, layout, (  # float16
        BufferHandle(0, 64), BufferHandle(0, 64), BufferHandle(8, 64)))
    decoded = hk.decode_descriptor(desc.encode())  # strictly valid
    return hk.BlockPagedTensor.from_descriptor(decoded, [b"", b"", bytes(8)],
                                               seq_lens=np.zeros(1, np.int64))


def test_an_output_numpy_cannot_shape_is_a_hurray_error_naming_it():
    t = _tensor((0, 4683743612465315842, 0))
    for read in (t.to_dense, lambda: t.gather(0), lambda: t.to_dense(dequantize=True)):
        with pytest.raises(hk.UnsupportedError,
                           match=r"shape: found \[0, 4683743612465315842, 0\].*2\^63-1"):
            read()
    # 3 * 2^60 float16 elements fit NumPy's limit, as float32 they do not
    t = _tensor((0, 3 << 60, 1))
    assert t.to_dense().shape == (0, 3 << 60, 1)
    with pytest.raises(hk.UnsupportedError, match=rf"shape: found \[0, {3 << 60}, 1\]"):
        t.gather(0, dequantize=True)
    # a page row of 2^62 float16 elements is 2^63 bytes: refused when the tensor is built
    with pytest.raises(hk.UnsupportedError, match=rf"shape: found \[1, {1 << 62}, 1\]"):
        _tensor((0, 1 << 62, 1))


# ------------------------------------------------------------------- 13 stale temporaries
def _temps_of(directory, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if temp_pattern(name).match(p.name))


def _age(path, seconds: float = 3600) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def test_a_later_save_removes_the_temporary_a_killed_save_left(tmp_path):
    target = tmp_path / "s.hrry"
    p = saving_forever(target, 1024)
    deadline = time.monotonic() + 30

    def written() -> bool:  # the temporary holds bytes (on a busy host it may be empty)
        temps = _temps_of(tmp_path, "s.hrry")
        with contextlib.suppress(OSError):
            return bool(temps) and (tmp_path / temps[0]).stat().st_size > 0
        return False

    while not written() and time.monotonic() < deadline:
        time.sleep(0.002)
    p.kill()
    p.wait(10)
    (left,) = _temps_of(tmp_path, "s.hrry")
    assert (tmp_path / left).stat().st_size > 0
    _age(tmp_path / left)  # the killed writer's file, untouched for an hour
    other = tmp_path / ".t.hrry.0123abcd.tmp"  # another target's: not this save's business
    other.write_bytes(b"x")
    _age(other)
    hk.save_snapshot(make_snapshot("float16"), target)
    assert _temps_of(tmp_path, "s.hrry") == [] and other.exists()
    assert hk.load_snapshot(target).equal(make_snapshot("float16"))


def test_a_temporary_a_live_writer_holds_is_never_removed(tmp_path):
    target = tmp_path / "s.hrry"
    code = ("import sys, time\n"
            "from hurraykv.io.hrry import HrryWriter\n"
            f"w = HrryWriter({str(target)!r})\n"
            "print(w._tmp, flush=True)\n"
            "sys.stdin.readline()\n"
            "w.finish()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        live = p.stdout.readline().strip()
        _age(live)  # old, but locked by a live writer
        young = tmp_path / ".s.hrry.00c0ffee.tmp"  # unlocked, written an instant ago
        young.write_bytes(b"y")
        hk.save_snapshot(make_snapshot("float16"), target)
        assert os.path.exists(live) and young.exists()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(30) == 0  # the live writer finishes: its rename finds its file
    finally:
        p.kill()
    assert not os.path.exists(live) and HrryFile.open(target).names == []


# ------------------------------------------------------------------- 14 planted links
def test_inspect_map_never_writes_through_a_planted_link(tmp_path, monkeypatch, capsys):
    from hurraykv.cli import main

    src = tmp_path / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), src)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "map.svg"
    names = iter(["deadbeef", "cafef00d", "0badf00d"])
    monkeypatch.setattr(secrets, "token_hex", lambda n=4: next(names))
    planted = [tmp_path / ".map.svg.tmp", tmp_path / ".map.svg.deadbeef.tmp",
               tmp_path / ".map.svg.cafef00d.tmp"]  # the old fixed name and the next two
    for link in planted:
        link.symlink_to(victim)
        _age(link)
    assert main(["inspect", "--map", str(out), str(src)]) == 0
    capsys.readouterr()
    assert victim.read_text() == "precious"
    assert not out.is_symlink() and out.read_text().startswith("<svg")
    assert all(link.is_symlink() for link in planted)  # links are neither followed nor taken


def test_snapshot_saves_never_write_through_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = iter(["deadbeef", "cafef00d"])
    monkeypatch.setattr(secrets, "token_hex", lambda n=4: next(names))
    (tmp_path / ".s.hrry.deadbeef.tmp").symlink_to(victim)
    hk.save_snapshot(make_snapshot("float16"), tmp_path / "s.hrry")
    assert victim.read_text() == "precious"
    assert hk.load_snapshot(tmp_path / "s.hrry").equal(make_snapshot("float16"))


# ------------------------------------------------------- issue 10: absurd dims
ABSURD = 18446181123756130312


def absurd_member(role: int) -> tuple[hk.TensorDescriptor, list[bytes]]:
    layout = BlockPaged(page_size=4, num_pages=0, num_seqs=0, kv_role=role, layer_index=0,
                        index_type=0)
    desc = hk.TensorDescriptor(0x01, (0, 2, ABSURD), layout,
                               (BufferHandle(0, 64), BufferHandle(0, 64), BufferHandle(4, 64)))
    return desc, [b"", b"", bytes(4)]


def absurd_members() -> list[tuple[str, hk.TensorDescriptor, list]]:
    return [("seq_lens", *seq_lens_member(np.zeros(0, np.uint64))),
            ("layers.0.key", *absurd_member(0)), ("layers.0.value", *absurd_member(1))]


def test_an_absurd_dimension_is_a_hurray_error_on_every_path(tmp_path):
    desc, bufs = absurd_member(0)
    decoded = hk.decode_descriptor(desc.encode())  # strictly valid on the wire
    with pytest.raises(hk.UnsupportedError, match=r"shape.*2\^63-1"):
        hk.BlockPagedTensor.from_descriptor(decoded, bufs)
    members = absurd_members()
    stream = io.BytesIO()
    write_tensor(stream, group_head(len(members)), [])
    for _, d, b in members:
        write_tensor(stream, d, b)
    with pytest.raises(hk.HurrayError):
        hk.read_snapshot_stream(io.BytesIO(stream.getvalue()))
    path = tmp_path / "absurd.hrry"
    write_hrry(path, [("snapshot", group_head(len(members)), []), *members])
    with pytest.raises(hk.HurrayError):
        hk.load_snapshot(path).layer(0)
    p = subprocess.run([sys.executable, "-m", "hurraykv.cli", "validate", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "UnsupportedError" in p.stderr


# ------------------------------------------------------- issue 10: temp files
def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


def test_the_server_removes_its_stale_temporary_files(tmp_path):
    stale = tmp_path / ".0123abcd.hrry.deadbeef.tmp"
    stale.write_bytes(bytes(1 << 16))
    mine = tmp_path / "notes.txt"
    mine.write_text("not the server's")
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread():
        assert _temps(tmp_path) == [] and mine.exists()


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_failed_save_leaves_no_temporary_file_and_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), path)
    before = path.read_bytes()
    from hurraykv.io import hrry

    calls = {"n": 0}
    real = hrry.HrryWriter._write

    def failing(self, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise error("disk on fire")
        real(self, data)

    monkeypatch.setattr(hrry.HrryWriter, "_write", failing)
    with pytest.raises(error):
        hk.save_snapshot(make_snapshot("int8", seed=3), path)
    assert _temps(tmp_path) == [] and path.read_bytes() == before


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_are_created_with_the_process_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "s.hrry")
    finally:
        os.umask(old)
    assert (tmp_path / "s.hrry").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_missing_directory_is_named_without_temporary_names(tmp_path):
    with pytest.raises(hk.ContainerError) as exc:
        hk.save_snapshot(make_snapshot("float16"), tmp_path / "nope" / "s.hrry")
    assert "nope" in str(exc.value) and "does not exist" in str(exc.value)
    assert ".tmp" not in str(exc.value)


def test_sigkill_during_save_keeps_the_old_file_and_a_restart_cleans_up(tmp_path):
    persist = tmp_path / "store"
    persist.mkdir()
    target = persist / "s.hrry"
    hk.save_snapshot(make_snapshot("float16"), target)
    before = target.read_bytes()
    p = saving_forever(target, 4096, pools=4)
    deadline = time.monotonic() + 30
    while not _temps(persist) and time.monotonic() < deadline:
        time.sleep(0.005)
    p.kill()
    p.wait(10)
    survivor = target.read_bytes()
    assert survivor == before or hk.load_snapshot(target).num_layers == 4  # old or new, whole
    with KVServer(listen="127.0.0.1:0", persist=str(persist)).run_in_thread():
        assert _temps(persist) == []


def test_a_targets_temporaries_are_told_apart_without_a_pattern_per_target():
    """``is_temp_of`` (no regex compiled per put) says what ``temp_pattern`` says, on names
    a directory may hold: other targets', look-alikes, regex characters, upper-case hex."""
    from hurraykv.io.atomic import is_temp_of

    names = ["a" * 32 + "-0.hrry", "x.y", "a+b", "(", ".", "k\n"]
    entries = [f".{n}.{h}.tmp" for n in names + ["other.hrry", "a" * 32 + "-0"]
               for h in ("0123abcd", "0123ABCD", "0123abc", "0123abcde", "0123abcg")]
    entries += [f".{n}.0123abcd.tmpx" for n in names] + [n for n in names]
    for name in names:
        for entry in entries:
            assert is_temp_of(entry, name) == bool(temp_pattern(name).match(entry)), (
                name, entry)
    assert sum(is_temp_of(e, names[0]) for e in entries) == 1
