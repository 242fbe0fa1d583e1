"""The README works as written: each ```python block runs on its own, in a fresh namespace
and with nothing injected, in the order a reader meets them (they share only the file
``batch.hrry`` the first one saves, as the text says). The one substitution: the server
and Redis examples name ``127.0.0.1:7878`` and ``redis://127.0.0.1:6379``, which become the
address of a server started here and of the suite's redis-server, since those examples
need a live server. The server shell example runs on a free port, every command its
synopsis lists answers ``--help``, the vLLM quickstart's config is one the connector takes,
and the short results table quotes `docs/benchmarks.md`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv.net.server import KVServer
from tests.support.redis_servers import free_port
from tests.support.snapshots import zeroed

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
SHELL = re.findall(r"```sh\n(.*?)```", README, re.S)


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## ``."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def run_block(number: int, swap: tuple[str, str] | None = None) -> dict:
    """README block ``number`` (1-based) in a namespace of its own: only what it defines."""
    code = BLOCKS[number - 1] if swap is None else BLOCKS[number - 1].replace(*swap)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md (python block {number})", "exec"), namespace)
    return namespace


def test_the_readme_has_its_examples():
    assert len(BLOCKS) == 3
    assert "KVCacheSnapshot.from_arrays" in BLOCKS[0] and "KVClient" in BLOCKS[1]
    assert "PageStore" in BLOCKS[2]
    for block in BLOCKS:  # each imports what it uses: no name comes from elsewhere
        assert "import hurraykv as hk" in block


def test_the_format_quickstart_defines_its_inputs_and_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = run_block(1)
    for name in ("key_pools", "value_pools", "block_table", "seq_ptr", "seq_lens", "seqs"):
        assert name in env, f"the format quickstart must define {name} itself"
    # block_table is flat, seq_ptr its offsets: sequence 1's entries start at seq_ptr[1]
    assert env["block_table"].ndim == 1 and env["seq_ptr"][-1] == len(env["block_table"])
    snap = env["snap"]
    assert snap.num_layers == 2 and snap.seq_lens.tolist() == env["seq_lens"].tolist()
    assert snap.model == "llama-3-8b" and snap.metadata["engine"] == "vllm"
    assert snap.layer(0)[0].shared_pages.tolist() == [0]  # the page its comment names
    assert env["same"].equal(env["key"]) and len(env["key"].shared_pages) == 1  # seqs[1][:16]
    assert (tmp_path / "batch.hrry").exists() and (tmp_path / "batch.stream").exists()


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """A directory holding the format quickstart's ``batch.hrry``, made by that block."""
    monkeypatch.chdir(tmp_path)
    run_block(1)
    return tmp_path


def test_the_server_quickstart_runs(saved):
    with KVServer(listen="127.0.0.1:0").run_in_thread() as server:
        env = run_block(2, ("127.0.0.1:7878", server.address))
    snap = hk.load_snapshot(saved / "batch.hrry")
    assert env["pulled"].equal(zeroed(snap))  # unused slots zeroed at the trust boundary
    assert env["again"].equal(env["pulled"]) and env["again"].model == "llama-3-8b"


def test_the_redis_quickstart_runs(saved, redis_url):
    env = run_block(3, ("redis://127.0.0.1:6379", redis_url))
    found = env["store"].lookup_prefix(env["new_prompt"])
    # what its comment says the lookup returns
    assert found == ("req-17", 0, 32)
    assert "-> (\"req-17\", 0, 32)" in BLOCKS[2]


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_every_example_block_compiles(block):
    compile(BLOCKS[block], f"README.md (block {block + 1})", "exec")


def _hurraykv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hurraykv.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_the_readme_server_example_runs(saved):
    """The serve / push / pull lines, as written, on a free port and a temporary DIR, with
    the batch.hrry the format quickstart saved."""
    block = next(b for b in SHELL if b.startswith("hurraykv serve"))
    serve, push, pull = (shlex.split(line.split("#")[0]) for line in block.splitlines())
    port = str(free_port())
    swap = {"127.0.0.1:7878": f"127.0.0.1:{port}", "./hurraykv-data": str(saved / "p")}
    server = subprocess.Popen([sys.executable, "-m", "hurraykv.cli",
                               *[swap.get(a, a) for a in serve[1:]]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "listening on ..."
        for line in (push, pull):
            done = _hurraykv(*[swap.get(a, a) for a in line[1:]], cwd=saved)
            assert done.returncode == 0, done.stderr
    finally:
        server.terminate()
        server.wait(10)
    back = hk.load_snapshot(saved / "restored.hrry")
    assert back.equal(zeroed(hk.load_snapshot(saved / "batch.hrry")))


@pytest.mark.slow  # ~9 s on 2 cores (each command's --help, a subprocess)
def test_every_command_the_readme_lists_exists():
    block = next(b for b in SHELL if b.startswith("hurraykv inspect PATH"))
    commands = sorted(set(re.findall(r"\bhurraykv ([a-z]+)", block)))
    assert {"inspect", "validate", "serve", "push", "pull", "stat", "store"} <= set(commands)
    for command in commands:
        done = _hurraykv(command, "--help")
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (command, done.stderr)
    assert _hurraykv("--version").returncode == 0


def synopsis() -> dict[tuple[str, ...], set[str]]:
    """The synopsis's commands (``("cache", "ls")``) and the options each line gives."""
    block = next(b for b in SHELL if b.startswith("hurraykv inspect PATH"))
    found: dict[tuple[str, ...], set[str]] = {}
    command: tuple[str, ...] = ()
    for line in block.splitlines():
        for part in line.split("#")[0].split(" / "):
            words = part.split()
            if not words or "COMMAND" in words:
                continue
            if words[0] == "hurraykv":
                command = tuple(w for w in words[1:3] if re.fullmatch(r"[a-z]+", w))
                command = command if command[0] in ("store", "cache") else command[:1]
            found.setdefault(command, set()).update(re.findall(r"--[a-z][a-z-]*", part))
    return found


def test_every_option_the_readme_lists_is_one_its_command_takes(capsys):
    from hurraykv.cli import build_parser

    listed = synopsis()
    assert ("validate",) in listed and "--json" in listed[("validate",)]
    assert "--json" in listed[("ls",)] and "--json" in listed[("stat",)]
    for command, options in listed.items():
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        shown = capsys.readouterr().out
        for option in options:
            assert option in shown, f"hurraykv {' '.join(command)} has no {option}"


def test_the_demo_commands_the_readme_shows_are_those_the_demo_prints():
    from hurraykv import demo

    shown = re.findall(r"^  \.venv/bin/hurraykv (.+)$", section("Start here"), re.M)
    assert shown == [t.format(f="demo.hrry", svg="demo.svg") for t in demo.TRY]


# ---- the vLLM quickstart ---------------------------------------------------------------
def vllm_config() -> dict:
    block = next(b for b in SHELL if b.startswith("vllm serve"))
    return json.loads(shlex.split(block, comments=True)[-1])


def test_the_vllm_quickstart_names_the_connector_as_vllm_names_its_own():
    config = vllm_config()
    assert config["kv_connector"] == "HurrayConnector" and config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"  # vLLM's default fails requests
    assert "kv_connector_module_path" not in config  # the plugin registers the name
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "entry-points"]["vllm.general_plugins"]
    assert "hurraykv.integrations.vllm_plugin:register" in plugins.values()
    assert "docs/vllm.md#quickstart" in section("Quickstart: vLLM")


def test_the_vllm_quickstart_config_is_one_the_connector_takes(tmp_path):
    from hurraykv.integrations.vllm.config import ConnectorConfig

    extra = vllm_config()["kv_connector_extra_config"]
    assert ConnectorConfig.from_extra(extra).url == "file:///var/cache/hurraykv"


# ---- what the README keeps, and where the rest went ------------------------------------
def test_the_two_setup_commands_are_stated():
    start = section("Start here")
    assert re.search(r"^make demo +#", start, re.M) and re.search(r"^make test +#", start, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: \$\(STAMP\)$", makefile, re.M)  # both build .venv from nothing
    assert re.search(r"^test: envs$", makefile, re.M)


def test_the_install_section_gives_cpu_torch_first_and_every_extra():
    install = section("Install into your own environment")
    cpu = install.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert cpu < install.index("pip install '.[adapters]'", cpu)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in set(extras) - {"test", "bench", "fuzz"}:  # the users' extras
        assert f"pip install '.[{extra}]'" in install, extra  # from a clone: not on PyPI


def results_rows() -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in section("Results").splitlines()
            if line.startswith("| ") and not line.startswith("| measured")]
    return [[c.strip() for c in row] for row in rows]


def test_the_results_table_quotes_docs_benchmarks():
    """Every figure of the README's short table is one docs/benchmarks.md printed: numbers
    with their unit (GiB/s, ms, x, n/200), each found there as written or, where the unit
    is the column's, as a table cell."""
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = results_rows()
    assert 5 <= len(rows) <= 10
    figure = re.compile(r"\d[\d,.]*(?: GiB/s| ms|x)|\d+/200 \(\d+%\)")
    for measured, value, against in rows:
        found = figure.findall(value + " " + against)
        assert found, (measured, value, against)
        for f in found:
            cell = rf"\|\s*{re.escape(f.removesuffix(' ms'))}\s*\|"
            assert f in benchmarks or re.search(cell, benchmarks), \
                f"README results: {f} ({measured}) is not in docs/benchmarks.md"
    assert "docs/benchmarks.md" in section("Results")
    assert any("MISSED" in row[2] for row in rows)  # a target missed is said so


def test_the_benchmarks_and_the_reliability_record_moved_whole():
    """What the README used to carry lives on in docs/: every table (from `make bench` and
    `make bench-vllm`) with the history, the campaign record with every fault."""
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = re.findall(r"```\n(.*?)```", benchmarks, re.S)
    assert len(tables) >= 19 and "## Benchmark history" in benchmarks
    for script in ("bench_paged.py", "bench_quant.py", "bench_snapshot.py", "bench_net.py",
                   "bench_store.py", "bench_capacity.py", "bench_vllm.py"):
        assert script in benchmarks
        assert (ROOT / "benchmarks" / script).exists()
    for only in ("serve", "zipf", "store_dtype", "store_dtype_speed", "hybrid", "retention"):
        assert f"--only {only}" in benchmarks
    reliability = (ROOT / "docs" / "reliability.md").read_text()
    for campaign in ("issue 19", "issue 29", "issue 24", "issue 23"):
        assert campaign in reliability
    assert "docs/reliability.md" in section("Reliability")
    assert "```\n" not in README.split("## Results")[1].split("## Conformance")[0]
