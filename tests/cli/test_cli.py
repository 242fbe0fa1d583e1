"""The hurraykv command as a user runs it: a real process, real files and pipes, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hurraykv as hk
from tests.support.paths import VECTORS
from tests.support.snapshots import make_snapshot


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_inspect_human_output_annotates_every_field():
    p = run("inspect", str(VECTORS / "worked_example_f16_key_layer3.bin"))
    assert p.returncode == 0, p.stderr
    for needle in ("0034  04 00 00 00", "page_size", "kv_role", "key", "layer_index",
                   "buffers[2].byte_size", "seq_ptr 12 bytes"):
        assert needle in p.stdout


def test_inspect_json_block_paged_layout():
    p = run("inspect", "--json", str(VECTORS / "fused_not_layer_scoped_bf16.bin"))
    out = json.loads(p.stdout)
    assert out["layout"] == {"page_size": 16, "num_pages": 3, "paged_axis": 0, "num_seqs": 2,
                             "kv_role": "fused", "layer_index": None,
                             "block_table_index_type": "uint32"}
    assert out["quantization"] is None and out["element_type"] == "bfloat16"


def test_validate_exit_codes(tmp_path):
    assert run("validate", str(VECTORS / "empty_batch.bin")).returncode == 0
    bad = run("validate", str(VECTORS / "invalid" / "r13_paged_axis_1.bin"))
    assert bad.returncode == 1
    assert "LayoutError" in bad.stderr and "paged_axis at byte 64" in bad.stderr
    relaxed = run("validate", "--permissive", str(VECTORS / "invalid" / "r13_paged_axis_1.bin"))
    assert relaxed.returncode == 0 and "relaxed 1 rule" in relaxed.stdout
    assert run("validate").returncode == 2
    assert run("validate", str(tmp_path / "missing.bin")).returncode == 2
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00" * 7)
    p = run("inspect", str(garbage))
    assert p.returncode == 1 and "DescriptorError" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # ~7.5 s on 2 cores (subprocesses)
def test_inspect_validate_and_compact_snapshots(tmp_path):
    import numpy as np

    import hurraykv as hk
    from tests.support.snapshots import make_snapshot

    s = make_snapshot("int8")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    with open(tmp_path / "s.stream", "wb") as f:
        hk.write_snapshot_stream(s, f)
    for name, kind in (("s.hrry", "hrry"), ("s.stream", "stream")):
        p = run("inspect", "--json", str(tmp_path / name))
        out = json.loads(p.stdout)
        assert out["kind"] == kind and out["snapshot"] and out["num_layers"] == 3
        assert out["seq_lens"] == [10, 6, 5, 1] and len(out["tensors"]) == 6
        row = out["tensors"][0]
        assert (row["name"], row["pages_referenced"], row["pages_shared"]) == (
            "layers.0.key", 7, 1)
        assert row["quantization"]["scheme"] == "per_block_affine"
        human = run("inspect", str(tmp_path / name)).stdout
        assert "layers.0-2.value" in human and "shared" in human
        v = run("validate", str(tmp_path / name))
        assert v.returncode == 0 and v.stderr == ""  # no progress bar off a terminal
    assert "model       : test-int8" in run("inspect", str(tmp_path / "s.hrry")).stdout
    c = run("compact", str(tmp_path / "s.hrry"), str(tmp_path / "c.hrry"))
    assert c.returncode == 0 and "42 of 54 pages kept" in c.stdout
    small = hk.load_snapshot(tmp_path / "c.hrry")
    for a, b in zip(small.tensors(), s.tensors(), strict=True):
        np.testing.assert_array_equal(a.to_dense(dequantize=True), b.to_dense(dequantize=True))
    raw = bytearray((tmp_path / "s.hrry").read_bytes())
    raw[-30] ^= 0xFF  # inside the trailer's index_length
    (tmp_path / "bad.hrry").write_bytes(bytes(raw))
    bad = run("validate", str(tmp_path / "bad.hrry"))
    assert bad.returncode == 1 and "ContainerError" in bad.stderr


def test_progress_bar_only_on_a_terminal_after_a_second(monkeypatch):
    import io

    from hurraykv.cli import progress as cli

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(cli.sys, "stderr", err)
    clock = iter([0.0, 0.5, 2.0])
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock, 3.0))
    bar = cli.Progress("saving")
    bar(10, 100)  # 0.5 s: too early to show
    assert err.getvalue() == ""
    bar(50, 100)
    bar.close()
    assert "saving [" in err.getvalue() and "50.0%" in err.getvalue()
    quiet = cli.Progress("saving", quiet=True)
    assert not quiet.enabled


def test_validate_a_stream_of_plain_tensors(tmp_path):
    import hurraykv as hk
    from hurraykv.io.stream import write_tensor
    from tests.vectors.make_vectors import WORKED, WORKED_BUFFERS

    path = tmp_path / "plain.stream"
    with open(path, "wb") as f:
        head = hk.TensorDescriptor(0x11, (1,), hk.wire.Composite(1, 1))
        write_tensor(f, head, [])  # a partition group around one tensor: no KV snapshot
        write_tensor(f, WORKED, WORKED_BUFFERS)
    p = run("validate", str(path))
    assert p.returncode == 0 and "no KV snapshot" in p.stdout, p.stderr
    torn = path.read_bytes()[:-5]  # the partition's member cut short: rejected
    (tmp_path / "torn.stream").write_bytes(torn)
    p = run("validate", str(tmp_path / "torn.stream"))
    assert p.returncode == 1 and "StreamError" in p.stderr
    with open(path, "wb") as f:
        write_tensor(f, hk.TensorDescriptor(0x03, (2,), hk.wire.RowMajor(),
                                            (hk.wire.BufferHandle(8),)), [bytes(8)])
    p = run("validate", str(path))
    assert p.returncode == 0 and "no KV snapshot" in p.stdout, p.stderr


# ---- issue 11: the command line a KV-cache engineer wants ----------------------------------
def _whole_pool(tmp_path):
    """An engine's whole pool (4096 pages per layer and role) saved for one 40-token
    request: 3 pages referenced."""
    import numpy as np

    import hurraykv as hk

    rng = np.random.default_rng(0)
    pools = [rng.standard_normal((4096, 16, 2, 64)).astype(np.float16) for _ in range(4)]
    snap = hk.KVCacheSnapshot.from_arrays(pools[:2], pools[2:], [17, 4000, 3], [0, 3], [40],
                                          kv_scales=None, model="llama-tiny",
                                          metadata={"engine": "vllm"})
    hk.save_snapshot(snap, tmp_path / "whole.hrry", fsync=False)
    return tmp_path / "whole.hrry"


def test_inspect_totals_in_human_units(tmp_path):
    path = _whole_pool(tmp_path)
    p = run("inspect", str(path))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "sequences   : 1, 40 tokens (min 40, median 40, max 40)" in out
    assert "pages       : 4,096 in each of 4 pools, 3 referenced (0 shared), 4,093 unused" in out
    assert "bytes       : 64.00 MiB of tensor data, file 64." in out
    assert "compact     : would save 63.95 MiB (99.9%)" in out
    assert "model       : llama-tiny" in out and "metadata    : engine = vllm" in out
    assert "layers.0-1.key" in out and "16.00 MiB each" in out  # identical layers collapsed
    data = json.loads(run("inspect", "--json", str(path)).stdout)
    assert data["totals"]["pages_in_pools"] == 4 * 4096
    assert data["totals"]["compact_saves"] == 4 * 4093 * 16 * 2 * 64 * 2
    assert data["seq_summary"] == {"count": 1, "tokens": 40, "min": 40, "median": 40.0,
                                   "max": 40}
    c = run("compact", str(path), str(tmp_path / "small.hrry"))
    assert c.returncode == 0 and "12 of 16,384 pages kept" in c.stdout


def test_inspect_seqs_and_fp8_scales(tmp_path):
    import hurraykv as hk
    from tests.support.snapshots import make_snapshot

    hk.save_snapshot(make_snapshot("fp8"), tmp_path / "f.hrry")
    out = run("inspect", "--seqs", str(tmp_path / "f.hrry")).stdout
    assert "sequences   : 4, 22 tokens (min 1, median 5.5, max 10)" in out
    assert "layer 0: k 0.5 v 1.5; layer 1: k 1.5 v 2.5; layer 2: k 2.5 v 3.5" in out
    assert "  1    6       2      [0, 3]" in out  # sequence 1 shares page 0


def test_inspect_map_draws_the_block_table(tmp_path):
    import xml.etree.ElementTree as ET

    import hurraykv as hk
    from tests.support.snapshots import make_snapshot

    s = make_snapshot("float16")  # 9 pool pages, page 0 shared, pages 7 and 8 unused
    hk.save_snapshot(s, tmp_path / "s.hrry")
    p = run("inspect", "--map", str(tmp_path / "map.svg"), str(tmp_path / "s.hrry"))
    assert p.returncode == 0, p.stderr
    root = ET.parse(tmp_path / "map.svg").getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class")]
    cells = [r for r in rects if r.get("class").startswith("page")]
    t = s.tensor(0, "key")
    assert [int(r.get("data-page")) for r in cells] == t.block_table.tolist()
    assert {int(r.get("data-page")) for r in cells if "shared" in r.get("class")} == {0}
    assert sum("partial" in r.get("class") for r in cells) == 4  # 10, 6, 5, 1 tokens in 4s
    pool = {int(r.get("data-first")): r.get("class") for r in rects
            if r.get("class").startswith("pool")}
    assert pool == {0: "pool shared", 1: "pool used", 2: "pool used", 3: "pool used",
                    4: "pool used", 5: "pool used", 6: "pool used", 7: "pool unused",
                    8: "pool unused"}
    big = _whole_pool(tmp_path)  # 4096 pages drawn as ranges
    assert run("inspect", "--map", str(tmp_path / "big.svg"), str(big)).returncode == 0
    root = ET.parse(tmp_path / "big.svg").getroot()
    pool = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")
            if (r.get("class") or "").startswith("pool")]
    assert len(pool) == 256 and sum(r.get("class") == "pool used" for r in pool) == 3
    missing = run("inspect", "--map", str(tmp_path / "no" / "m.svg"), str(big))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_version_and_help_name_units_and_defaults():
    v = run("--version")
    assert v.returncode == 0 and v.stdout.startswith("hurraykv 0.1.0")
    h = run("serve", "--help").stdout
    for needle in ("default: unlimited", "8G or 512M", "default 16M", "default 30",
                   "default 600", "default 256", "SERVER_BUSY"):
        assert needle in " ".join(h.split()), needle
    assert "verifies the server's certificate" in " ".join(run("push", "--help").stdout.split())
    for bad in ("0", "-1G", "lots"):
        p = run("serve", "--memory-budget", bad)
        assert p.returncode == 2 and "--memory-budget" in p.stderr, bad


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                             "127.0.0.1:0", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()[-1]


@pytest.mark.slow  # ~11 s on 2 cores (subprocesses)
def test_serve_ls_stat_rm(tmp_path):
    import hurraykv as hk
    from tests.support.snapshots import make_snapshot

    hk.save_snapshot(make_snapshot("float16"), tmp_path / "s.hrry")
    proc, address = _serve("--memory-budget", "64M")
    try:
        assert "memory budget 64.00 MiB" in proc.stdout.readline()
        for key in ("a/one", "a/two", "b"):
            assert run("push", "--quiet", address, key, str(tmp_path / "s.hrry")).returncode == 0
        ls = run("ls", address, "a/")
        assert ls.returncode == 0 and "a/one" in ls.stdout and "b\n" not in ls.stdout
        assert "2 keys" in ls.stdout and "KiB" in ls.stdout
        st = run("stat", address)
        assert "objects      : 3 in memory" in st.stdout and "budget       : 64.00 MiB" in \
            st.stdout
        assert run("rm", address, "a/one").returncode == 0
        assert "a/one" not in run("ls", address).stdout
        gone = run("pull", address, "a/one", str(tmp_path / "x.hrry"))
        assert gone.returncode == 1 and "a/one" in gone.stderr
        nodir = run("pull", address, "b", str(tmp_path / "nope" / "x.hrry"))
        assert nodir.returncode == 2 and "nope" in nodir.stderr and ".tmp" not in nodir.stderr
        (tmp_path / "bad.hrry").write_bytes(b"HRRYFILE" + bytes(200))
        bad = run("push", address, "c", str(tmp_path / "bad.hrry"))
        assert bad.returncode == 1 and str(tmp_path / "bad.hrry") in bad.stderr
        assert address not in bad.stderr  # the local file's fault, not the server's
    finally:
        proc.terminate()
        proc.wait(10)


def test_serving_beyond_loopback_without_tls_warns():
    proc = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                             "0.0.0.0:0", "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "without TLS" in line and "--tls-cert" in line
    finally:
        proc.terminate()
        proc.wait(10)


def test_unreachable_server_and_wrong_formats(tmp_path):
    import socket

    import numpy as np

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run("ls", f"127.0.0.1:{port}")
    assert p.returncode == 2 and f"127.0.0.1:{port}" in p.stderr
    assert "is `hurraykv serve` running there?" in p.stderr
    p = run("stat", f"http://127.0.0.1:{port}")
    assert p.returncode != 0 and "http" in p.stderr
    np.save(tmp_path / "x.npy", np.zeros(3))
    p = run("inspect", str(tmp_path / "x.npy"))
    assert p.returncode == 1 and "this is a NumPy .npy file" in p.stderr
    (tmp_path / "empty").write_bytes(b"")
    p = run("validate", str(tmp_path / "empty"))
    assert p.returncode == 1 and "empty file" in p.stderr


def test_pull_progress_knows_its_total(tmp_path):
    from hurraykv.net.client import KVClient
    from hurraykv.net.server import KVServer
    from tests.support.snapshots import make_snapshot

    s = make_snapshot("float16", layers=4)
    seen: list[tuple[int, int]] = []
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st, KVClient(st.address) as c:
        c.push("k", s)
        c.pull("k", progress=lambda done, total: seen.append((done, total)))
    totals = {t for _, t in seen}
    assert len(totals) == 1 and totals.pop() >= seen[-1][0] > 0
    assert seen[0][0] < seen[-1][0]  # it moves: not 100% from the first frame


# ---- pipes (issue 10) -----------------------------------------------------------------
def _cli_pipe(args: list[str], data: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args], input=data,
                          capture_output=True, timeout=60)


@pytest.mark.slow  # ~11 s on 2 cores (subprocesses)
def test_validate_and_inspect_read_a_pipe_once(tmp_path):
    s = make_snapshot("fp8")
    hk.save_snapshot(s, tmp_path / "s.hrry")
    raw = (tmp_path / "s.hrry").read_bytes()
    with open(tmp_path / "s.stream", "wb") as fh:
        hk.write_snapshot_stream(s, fh)
    for arg in ("-", "/dev/stdin"):
        ok = _cli_pipe(["validate", arg], raw)
        assert ok.returncode == 0 and b"valid hrry, KVCacheSnapshot(3 layers" in ok.stdout
        stream = _cli_pipe(["validate", arg], (tmp_path / "s.stream").read_bytes())
        assert stream.returncode == 0 and b"valid stream, KVCacheSnapshot" in stream.stdout
        cut = _cli_pipe(["validate", arg], raw[: len(raw) // 2])
        assert cut.returncode == 1 and b"valid" not in cut.stdout
        tail = bytearray(raw)
        tail[-30] ^= 0xFF  # a corrupt trailer
        bad = _cli_pipe(["validate", arg], bytes(tail))
        assert bad.returncode == 1 and b"ContainerError" in bad.stderr
    piped = _cli_pipe(["inspect", "-"], raw)
    direct = subprocess.run([sys.executable, "-m", "hurraykv.cli", "inspect",
                             str(tmp_path / "s.hrry")], capture_output=True, timeout=60)
    assert piped.returncode == 0
    assert piped.stdout.replace(b"<stdin>", str(tmp_path / "s.hrry").encode()) == direct.stdout


@pytest.mark.parametrize(("url", "said"), [("redis://127.0.0.1:1", "cannot reach it"),
                                           ("file:///tmp/x", "redis://HOST:PORT")])
def test_store_fsck_of_a_store_it_cannot_reach_is_a_usage_exit_not_a_traceback(url, said,
                                                                             capsys):
    from hurraykv.cli import main

    assert main(["store", "fsck", url]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
