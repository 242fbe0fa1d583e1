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
