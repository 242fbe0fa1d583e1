"""The hurraykv command as a user runs it: a real process, real files, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import VECTORS


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


def test_inspect_validate_and_compact_snapshots(tmp_path):
    import numpy as np

    import hurraykv as hk
    from tests.snapshots import make_snapshot

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
        assert "layers.2.value" in human and "shared" in human
        v = run("validate", str(tmp_path / name))
        assert v.returncode == 0 and v.stderr == ""  # no progress bar off a terminal
    assert "kv hurraykv.model = test-int8" in run("inspect", str(tmp_path / "s.hrry")).stdout
    c = run("compact", "--quiet", str(tmp_path / "s.hrry"), str(tmp_path / "c.hrry"))
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

    from hurraykv import cli

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
                                            (hk.BufferHandle(8),)), [bytes(8)])
    p = run("validate", str(path))
    assert p.returncode == 0 and "no KV snapshot" in p.stdout, p.stderr
