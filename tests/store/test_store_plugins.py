"""Stores from outside the package (issue 34): a distribution that registers a store
through the ``hurraykv.chunk_stores`` entry point (``tests/support/plugins/toy_store``:
``toy:///DIR`` with an option of its own, ``bucket``; a real ``.dist-info`` found on
``sys.path``, as an installed one is) is listed and opened, passes the whole contract
(``hurraykv.testing.ChunkStoreTests``), and is configured by the connector and listed by
``hurraykv cache ls`` with no edit of the package; plugins that fail to import or take a
built-in's scheme (``tests/support/plugins/broken_stores``) are skipped with a warning naming
them, and the built-ins work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hurraykv.errors import HurrayError
from hurraykv.integrations import chunks
from hurraykv.testing import ChunkStoreTests, keys, segment

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "support" / "plugins"
TOY, BROKEN = PLUGINS / "toy_store", PLUGINS / "broken_stores"


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
    (the distributions it finds, as if installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
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
    from hurraykv.integrations.chunks import ChunkStore

    def opener(cls, url, parsed, *, timeout, **options):
        raise AssertionError("never opened")

    for scheme, owner in (("file", r"the built-in hurraykv\.integrations\.file_store\."
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
        "file:///DIR takes it" in got["not_its_own"][1]
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
                      (("-o", "max_bytes=1G", url), "file:///DIR takes it")]:
        refused = cli("cache", "ls", *args)
        assert refused.returncode == 2 and why in refused.stderr, (args, refused.stderr)


def test_a_broken_plugin_is_skipped_with_a_warning_and_the_builtins_work(tmp_path):
    out = python(f"""
import json, warnings
from hurraykv.integrations import chunks

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
                                "'file', which the built-in hurraykv.integrations.file_store."
                                "FileChunks opens already")


def test_nothing_in_the_package_imports_its_testing_module():
    src = ROOT / "src" / "hurraykv"
    statement = re.compile(r"^\s*(from|import)\s+(hurraykv|\.*)\.?testing\b", re.M)
    importers = [p.relative_to(src) for p in src.rglob("*.py")
                 if "testing" not in p.parts and statement.search(p.read_text())]
    assert importers == []
    out = python("import sys, hurraykv\nfrom hurraykv.integrations import chunks\n"
                 "chunks.schemes()\nprint(sorted(m for m in sys.modules if m == 'pytest' or "
                 "m.startswith('hurraykv.testing')))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
