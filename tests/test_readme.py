"""The README's examples run as written: each block of ``README.md``'s ```python fences is
executed, in order, with the inputs it names but does not build (``key_pools``, ``seqs``,
``prompts``, ...) defined here, against a real server and a real Redis; its server shell
example runs on a free port, and every command its synopsis lists answers ``--help``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hurraykv.net.server import KVServer
from tests.redis_servers import free_port
from tests.snapshots import zeroed

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

PAGE, HEADS, DIM = 16, 2, 8


def inputs() -> dict:
    """What the examples take as given: an engine's pools and block table, sequences."""
    rng = np.random.default_rng(0)
    lens = [40, 23]
    pages = [-(-n // PAGE) for n in lens]
    table = np.arange(sum(pages), dtype=np.int32)
    pools = [rng.standard_normal((sum(pages), PAGE, HEADS, DIM)).astype(np.float16)
             for _ in range(4)]
    return {"key_pools": pools[:2], "value_pools": pools[2:], "block_table": table,
            "seq_ptr": np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
            "seq_lens": np.array(lens, np.int32),
            "seqs": [rng.standard_normal((n, HEADS, DIM)).astype(np.float16) for n in lens],
            "prompts": [rng.integers(0, 32000, n) for n in lens]}


def test_the_readme_has_its_examples():
    assert len(BLOCKS) == 3 and "KVCacheSnapshot.from_arrays" in BLOCKS[0]


def test_the_readme_examples_run(tmp_path, monkeypatch, redis_url):
    monkeypatch.chdir(tmp_path)
    env = inputs()
    exec(compile(BLOCKS[0], "README.md (block 1)", "exec"), env)
    assert env["same"].equal(env["key"]) and env["snap"].metadata == {"engine": "vllm"}
    with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
        with __import__("hurraykv").KVClient(st.address) as c:
            c.push("batch-18", env["snap"])  # the example pulls it into its own memory
        exec(compile(BLOCKS[1].replace("127.0.0.1:7878", st.address), "README.md (block 2)",
                     "exec"), env)
    assert env["snap"].model == "llama-3-8b"
    env["new_prompt"] = np.concatenate([env["prompts"][0][:32], [7, 7, 7]])
    exec(compile(BLOCKS[2].replace("redis://127.0.0.1:6379", redis_url),
                 "README.md (block 3)", "exec"), env)
    store = env["store"]
    found = store.lookup_prefix(env["new_prompt"])
    assert found is not None and found[0] == "req-17" and found[2] >= 32


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_every_example_block_compiles(block):
    compile(BLOCKS[block], f"README.md (block {block + 1})", "exec")


SHELL = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _hurraykv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_the_readme_server_example_runs(tmp_path):
    """The serve / push / pull lines, as written, on a free port and a temporary DIR."""
    block = next(b for b in SHELL if b.startswith("hurraykv serve"))
    serve, push, pull = (shlex.split(line.split("#")[0]) for line in block.splitlines())
    port = str(free_port())
    swap = {"127.0.0.1:7878": f"127.0.0.1:{port}", "/var/lib/hurraykv": str(tmp_path / "p")}
    env = inputs()
    snap = __import__("hurraykv").KVCacheSnapshot.from_arrays(
        env["key_pools"], env["value_pools"], env["block_table"], env["seq_ptr"],
        env["seq_lens"])
    __import__("hurraykv").save_snapshot(snap, tmp_path / "batch.hrry")
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli",
                               *[swap.get(a, a) for a in serve[1:]]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "listening on ..."
        for line in (push, pull):
            done = _hurraykv(*[swap.get(a, a) for a in line[1:]], cwd=tmp_path)
            assert done.returncode == 0, done.stderr
    finally:
        server.terminate()
        server.wait(10)
    back = __import__("hurraykv").load_snapshot(tmp_path / "restored.hrry")
    assert back.equal(zeroed(snap))  # the server zeroes unused slots (a trust boundary)


def test_every_command_the_readme_lists_exists():
    block = next(b for b in SHELL if b.startswith("hurraykv inspect PATH"))
    commands = sorted(set(re.findall(r"\bhurraykv ([a-z]+)", block)))
    assert {"inspect", "validate", "serve", "push", "pull", "stat", "store"} <= set(commands)
    for command in commands:
        done = _hurraykv(command, "--help")
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (command, done.stderr)
    assert _hurraykv("--version").returncode == 0
