"""Stores from outside the package (issue 34): a distribution that registers a store
through the ``hurraykv.chunk_stores`` entry point (``tests/support/plugins/toy_store``:
``toy:///DIR`` with an option of its own, ``bucket``; a real ``.dist-info`` found on
``sys.path``, as an installed one is) is listed and opened, passes the whole contract
(``hurraykv.testing.ChunkStoreTests``), and is configured by the connector and listed by
``hurraykv cache ls`` with no edit of the package; plugins that fail to import or take a
built-in's scheme (``tests/support/plugins/broken_stores``) are skipped with a warning naming
them, and the built-ins work; one that raises SystemExit on import
(``tests/support/plugins/exiting``) is skipped alike by every command that loads plugins;
a store whose ``open`` raises or never returns (``tests/support/plugins/faulty_open``) is
one HurrayError naming it, the second after the timeout given."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hurraykv import chunks
from hurraykv.errors import ConfigError, HurrayError, TransportError
from hurraykv.testing import ChunkStoreTests, keys, segment

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "support" / "plugins"
TOY, BROKEN = PLUGINS / "toy_store", PLUGINS / "broken_stores"
EXITING, FAULTY = PLUGINS / "exiting", PLUGINS / "faulty_open"


@pytest.fixture(scope="module")
def toy():
    """The toy distribution on ``sys.path`` and its entry point loaded: the store class;
    unregistered after the module's tests."""
    sys.path.insert(0, str(TOY))
    try:
        assert chunks.load_plugins() == []
        cls = chunks.store_class("toy")
        assert cls is not None
        yield cls
        chunks.unregister(cls)
    finally:
        sys.path.remove(str(TOY))


def python(code: str, *paths: Path, args: tuple[str, ...] = ()
           ) -> subprocess.CompletedProcess:
    """``code`` (given ``args``) in a new interpreter whose ``PYTHONPATH`` holds ``paths``
    (the distributions it finds, as if installed), then the one it was given (a mutated
    copy of src, tests/mutants.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)


def test_the_entry_point_registers_the_store_after_the_builtins(toy, tmp_path):
    builtin = [s for c in chunks.store_classes(plugins=False) for s in c.SCHEMES]
    assert list(chunks.schemes()) == [*builtin, "toy"]
    assert toy.__module__ == "toy_store" and toy not in chunks.store_classes(plugins=False)
    store = chunks.open_store(f"toy://{tmp_path}", bucket="b")
    assert isinstance(store, toy) and store.root == tmp_path / "b"
    k = keys(2)
    store.put(k, 0, segment(2, 1), {})
    assert store.get_verified(store.locate(k)[0]).equal(segment(2, 1))
    assert "toy:///DIR" in chunks.url_forms() and chunks.is_local(f"toy://{tmp_path}")
    from hurraykv.integrations.vllm.events import locality_of

    assert locality_of(f"toy://{tmp_path}") == "LOCAL"
    # its option is its own: no other store takes it, and its URL is checked as any
    with pytest.raises(HurrayError, match=r"option 'bucket' is not one a file:// store "
                                          r"takes .*; toy:///DIR takes it"):
        chunks.open_store(tmp_path.as_uri(), bucket="b")
    with pytest.raises(HurrayError, match=r"a toy URL names an absolute directory"):
        chunks.open_store("toy:relative")


def test_a_class_naming_a_taken_scheme_is_refused_and_the_builtin_keeps_it(toy):
    from hurraykv.chunks.registry import ChunkStore

    def opener(cls, url, parsed, *, timeout, **options):
        raise AssertionError("never opened")

    for scheme, owner in (("file", r"the built-in hurraykv\.chunks\.file\.store\."
                                   r"FileChunks"), ("toy", r"toy_store\.ToyChunks")):
        with pytest.raises(TypeError, match=rf"names scheme '{scheme}', which {owner} opens "
                                            "already"):
            type("Clash", (ChunkStore,), {"SCHEMES": ("x-new", scheme), "FORM": "x://",
                                          "open": classmethod(opener)})
        assert chunks.store_class("x-new") is None
    assert chunks.store_class("file").__name__ == "FileChunks"
    assert chunks.store_class("toy") is toy
    # a subclass of a store (a wrapper, a fault injector) takes none of its schemes
    wrapper = type("Wrapper", (toy,), {})
    assert chunks.store_class("toy") is toy and wrapper not in chunks.store_classes()
    with pytest.raises(TypeError, match=r"an option is an Option of kind str, size"):
        type("Odd", (ChunkStore,), {"SCHEMES": ("x-odd",), "open": classmethod(opener),
                                    "OPTIONS": (chunks.Option("depth", "list"),)})
    assert chunks.store_class("x-odd") is None


class TestToyStore(ChunkStoreTests):
    """The contract, as a third party runs it against its own store."""

    @pytest.fixture
    def make(self, toy, tmp_path):
        return lambda: chunks.open_store(f"toy://{tmp_path}", bucket="contract")

    @pytest.fixture
    def capped(self):
        return None  # the toy store has no capacity


def test_the_connector_config_and_the_cli_take_the_store_without_an_edit(toy, tmp_path):
    store = chunks.open_store(f"toy://{tmp_path}")  # the default bucket
    k = keys(3)
    store.put(k, 0, segment(3, 2).with_info(model="model=toy"), {})
    name = store.locate(k)[0]
    url = f"toy://{tmp_path}"
    out = python(f"""
import json
from hurraykv.errors import HurrayError
from hurraykv.integrations.vllm.config import ConnectorConfig

def refusal(extra):
    try:
        ConnectorConfig.from_extra(extra)
    except HurrayError as e:
        return [e.field, str(e)]

print(json.dumps({{
    "options": ConnectorConfig.from_extra({{"url": {url!r}, "bucket": "b1"}}).store_options,
    "misspelled": refusal({{"url": {url!r}, "buket": "b1"}}),
    "typed": refusal({{"url": {url!r}, "bucket": 3}}),
    "another_store": refusal({{"url": "file:///kv", "bucket": "b1"}}),
    "not_its_own": refusal({{"url": {url!r}, "max_bytes": "1G"}}),
}}))
""", TOY)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["options"] == {"bucket": "b1"}
    field, why = got["misspelled"]
    assert field == "kv_connector_extra_config"
    assert "unknown key(s) ['buket']; did you mean 'bucket'?" in why
    assert why.endswith(", bucket") and "max_bytes" in why and "tls_cert" in why
    assert got["typed"] == ["bucket", "kv_connector_extra_config['bucket'] is 3; it is a "
                            "non-empty string (leave the key out for its default)"]
    assert got["another_store"][0] == "url"
    assert "option 'bucket' is not one a file:// store takes (its options: max_bytes, " \
        "max_pinned_bytes, max_bytes_per_tenant); toy:///DIR takes it" in got["another_store"][1]
    assert "option 'max_bytes' is not one a toy:// store takes (its options: bucket); " \
        "file:///DIR, mem://[NAME] and s3://BUCKET/PREFIX take it" in got["not_its_own"][1]
    other = chunks.open_store(url, bucket="b1")
    other.put(keys(1), 0, segment(1, 3).with_info(model="model=b1"), {})

    def cli(*args: str) -> subprocess.CompletedProcess:
        return python("import sys; from hurraykv.cli import main; sys.exit(main(sys.argv[1:]))",
                      TOY, args=args)

    listed = cli("cache", "ls", "--json", url)
    assert listed.returncode == 0, listed.stderr
    segments = json.loads(listed.stdout)["segments"]
    assert [(s["name"], s["identity"]) for s in segments] == [(name, "model=toy")]
    listed = cli("cache", "ls", "--json", "--option", "bucket=b1", url)  # its own option
    assert listed.returncode == 0, listed.stderr
    assert [s["identity"] for s in json.loads(listed.stdout)["segments"]] == ["model=b1"]
    for args, why in [((f"{url}/nowhere",), "no such directory"),
                      (("-o", "buket=b1", url), "option 'buket' is not one a toy:// store takes "
                                                "(its options: bucket); did you mean "
                                                "'bucket'?"),
                      (("-o", "bucket=", url), "--option bucket is ''; it is a non-empty "
                                               "string"),
                      (("-o", "bucket", url), "--option 'bucket' is not NAME=VALUE"),
                      (("-o", "max_bytes=1G", url),
                           "file:///DIR, mem://[NAME] and s3://BUCKET/PREFIX take it")]:
        refused = cli("cache", "ls", *args)
        assert refused.returncode == 2 and why in refused.stderr, (args, refused.stderr)


def test_a_broken_plugin_is_skipped_with_a_warning_and_the_builtins_work(tmp_path):
    out = python(f"""
import json, warnings
from hurraykv import chunks

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    schemes = chunks.schemes()
store = chunks.open_store({tmp_path.as_uri()!r})
store.put(["a" * 32], 0, __import__("hurraykv.testing").testing.segment(1, 0), {{}})
print(json.dumps({{"schemes": schemes, "file": chunks.store_class("file").__name__,
                   "found": store.locate(["a" * 32])[0],
                   "warnings": [[w.category.__name__, str(w.message)] for w in caught],
                   "again": chunks.load_plugins()}}))
""", BROKEN, TOY)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["schemes"][-1] == "toy" and "broken" not in got["schemes"]
    assert got["file"] == "FileChunks" and got["found"] == "a" * 32 + "-0"
    assert got["again"] == []  # each entry point is tried once
    (broken, broken_why), (clash, clash_why) = sorted(got["warnings"], key=str)
    assert broken == clash == "StorePluginWarning"
    assert broken_why == ("the hurraykv.chunk_stores entry point 'broken' = 'broken_store' "
                          "(distribution broken-store-plugins 0.1) is skipped: "
                          "ModuleNotFoundError: No module named 'hurraykv_missing_dependency'")
    assert clash_why.startswith("the hurraykv.chunk_stores entry point 'clash' = "
                                "'clash_store' (distribution broken-store-plugins 0.1) is "
                                "skipped: TypeError: clash_store.ClashChunks names scheme "
                                "'file', which the built-in hurraykv.chunks.file.store."
                                "FileChunks opens already")


def test_nothing_in_the_package_imports_its_testing_module():
    src = ROOT / "src" / "hurraykv"
    statement = re.compile(r"^\s*(from|import)\s+(hurraykv|\.*)\.?testing\b", re.M)
    importers = [p.relative_to(src) for p in src.rglob("*.py")
                 if "testing" not in p.parts and statement.search(p.read_text())]
    assert importers == []
    out = python("import sys, hurraykv\nfrom hurraykv import chunks\n"
                 "chunks.schemes()\nprint(sorted(m for m in sys.modules if m == 'pytest' or "
                 "m.startswith('hurraykv.testing')))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def cli(*args: str, paths: tuple[Path, ...]) -> subprocess.CompletedProcess:
    """``hurraykv ARGS`` in a new interpreter that finds the distributions in ``paths``."""
    return python("import sys; from hurraykv.cli import main; sys.exit(main(sys.argv[1:]))",
                  *paths, args=args)


def test_a_plugin_raising_systemexit_on_import_is_skipped_by_every_command(tmp_path):
    # issue 46 item 7: `raise SystemExit("requires X")` in a plugin module ended every
    # command that loads plugins, whichever of the three groups named it
    import hurraykv as hk
    from tests.support.snapshots import make_snapshot

    skipped = ("entry point {} = 'exiting_plugin' (distribution exiting-plugins 0.1) is "
               "skipped: SystemExit: exiting_plugin requires hurraykv-acme-sdk")
    listed = cli("cache", "ls", "--json", tmp_path.as_uri(), paths=(EXITING,))
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["segments"] == []
    assert "StorePluginWarning: the hurraykv.chunk_stores " + skipped.format("'exiting'") \
        in listed.stderr, listed.stderr
    path = tmp_path / "int8.hrry"
    hk.save_snapshot(make_snapshot("int8", layers=1), path)
    checked = cli("validate", str(path), paths=(EXITING,))
    assert checked.returncode == 0 and "valid hrry" in checked.stdout, checked.stderr
    assert "SchemePluginWarning: the hurraykv.quant_schemes " + \
        skipped.format("'exiting'") in checked.stderr, checked.stderr
    quantized = python("import numpy as np, hurraykv as hk\n"
                       "t = hk.BlockPagedTensor(np.ones((2, 4, 2, 8), np.float32), [0, 1], "
                       "[0, 2], [8])\n"
                       "print(t.quantize('per_block_affine', 'int8').decode_pages(0, 2).sum())",
                       EXITING)
    assert quantized.returncode == 0 and quantized.stdout.strip() == "128.0", \
        quantized.stderr
    assert "hurraykv.quant_schemes " + skipped.format("'exiting'") in quantized.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(EXITING), *filter(None, [os.environ.get("PYTHONPATH")])])}
    served = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = served.stdout.readline()
    finally:
        served.terminate()
        _, err = served.communicate(timeout=20)
    assert "listening on" in line, err
    assert "OperationPluginWarning: the hurraykv.server_operations " + \
        skipped.format("'acme.exiting'") in err, err


@pytest.fixture(scope="module")
def faulty():
    """The faulty_open distribution loaded: ``failing://``, ``stuck://`` and ``slow://``
    registered."""
    sys.path.insert(0, str(FAULTY))
    try:
        assert chunks.load_plugins() == []
        classes = [chunks.store_class(s) for s in ("failing", "stuck", "slow")]
        assert None not in classes
        yield classes
        for cls in classes:
            chunks.unregister(cls)
    finally:
        sys.path.remove(str(FAULTY))


def test_a_store_whose_open_raises_is_one_error_naming_the_store_and_the_cause(
        faulty, tmp_path):
    url = f"failing://{tmp_path}"
    with pytest.raises(ConfigError) as e:
        chunks.open_store(url, timeout=5.0)
    assert str(e.value) == (
        f"url {url!r}: the store cannot be opened: faulty_open_store.FailingChunks (the "
        "hurraykv.chunk_stores entry point 'faulty' of faulty-open-stores 0.1) raised "
        "RuntimeError: the acme SDK is not configured: set ACME_HOME")
    assert e.value.field == "url"
    refused = cli("cache", "ls", url, paths=(FAULTY,))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [f"hurraykv: {e.value}"]


def test_a_store_whose_open_never_returns_is_given_up_after_the_timeout(faulty, tmp_path):
    url = f"stuck://{tmp_path}"
    started = time.monotonic()
    with pytest.raises(TransportError) as e:
        chunks.open_store(url, timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 5
    assert str(e.value) == (
        f"url {url!r}: the store did not open within the timeout of 0.5 s: "
        "faulty_open_store.StuckChunks (the hurraykv.chunk_stores entry point 'faulty' of "
        "faulty-open-stores 0.1) never returned from open")
    started = time.monotonic()
    refused = cli("cache", "ls", "--timeout", "1", url, paths=(FAULTY,))
    assert refused.returncode == 2, refused.stderr
    assert time.monotonic() - started < 60
    assert refused.stderr.splitlines() == [f"hurraykv: {str(e.value).replace('0.5 s', '1 s')}"]
    for bad in ("0", "-1", "inf", "nan"):
        refused = cli("cache", "ls", "--timeout", bad, url, paths=(FAULTY,))
        assert refused.returncode == 2 and "is a number of seconds above 0" in \
            refused.stderr, (bad, refused.stderr)


def test_a_store_that_opens_after_it_was_given_up_on_is_closed(faulty, tmp_path):
    import faulty_open_store  # the module the entry point loaded

    with pytest.raises(TransportError, match=r"within the timeout of 0\.2 s"):
        chunks.open_store(f"slow://{tmp_path}", timeout=0.2)
    assert not faulty_open_store.LATE_CLOSED.is_set()
    assert faulty_open_store.LATE_CLOSED.wait(10)  # its open returned a second later
