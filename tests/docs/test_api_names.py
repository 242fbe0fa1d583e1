"""Names kept for compatibility (issue 21): deprecated aliases still work, and warn;
what ``import hurraykv`` needs, and a missing optional package named by its extra."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import hurraykv as hk
from hurraykv import errors, wire


def test_buffer_error_is_a_deprecated_alias_that_no_longer_shadows_the_builtin():
    assert hk.BufferError is hk.HurrayBufferError is errors.BufferError
    assert issubclass(hk.HurrayBufferError, hk.HurrayError)
    assert not issubclass(hk.HurrayBufferError, BufferError)  # Python's builtin
    assert "BufferError" not in vars(wire.buffers)  # floor 0 names the new class


@pytest.mark.parametrize("name", ["ELEMENT_TYPES", "BlockPaged", "BufferHandle",
                                  "ElementType", "element_type", "pack", "unpack"])
def test_wire_helpers_moved_to_hurraykv_wire(name):
    assert name not in hk.__all__
    with pytest.warns(DeprecationWarning, match=f"hurraykv.{name} is deprecated"):
        moved = getattr(hk, name)
    assert moved is getattr(wire, name)


def test_top_level_keeps_what_the_readme_uses():
    for name in ("KVCacheSnapshot", "BlockPagedTensor", "save_snapshot", "load_snapshot",
                 "write_snapshot_stream", "SnapshotStreamReader", "decode_descriptor",
                 "TensorDescriptor", "KVClient", "KVServer", "PageStore", "HurrayError",
                 "BufferError"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(hk, name) is not None


def test_kvclient_list_is_a_deprecated_alias_of_list_keys():
    thread = hk.KVServer(listen="127.0.0.1:0").run_in_thread()
    try:
        with hk.KVClient(thread.address) as client:
            assert client.list_keys() == []
            with pytest.warns(DeprecationWarning, match="list_keys"):
                assert client.list() == []
    finally:
        thread.stop()


# ---- imports ---------------------------------------------------------------------------
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_hurraykv_needs_neither_torch_nor_redis():
    p = _python("import sys, hurraykv as hk\n"
                "assert 'torch' not in sys.modules and 'redis' not in sys.modules\n"
                "assert hk.KVClient.__name__ == 'KVClient' and hk.PageStore\n"
                "assert 'redis' not in sys.modules\n"
                "assert issubclass(hk.RemoteError, hk.HurrayError)\n"
                "assert issubclass(hk.StoreError, hk.HurrayError)\n")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(("missing", "code", "extra"), [
    ("torch", "import hurraykv.adapters.vllm", "adapters"),
    ("redis", "from hurraykv.store import PageStore; PageStore.from_url('redis://x:1')",
     "redis"),
])
def test_a_missing_optional_package_names_the_extra(missing, code, extra):
    p = _python(f"import sys; sys.modules[{missing!r}] = None\n"
                "import hurraykv as hk\n"
                f"try:\n    {code}\n"
                "except hk.MissingDependencyError as e:\n"
                "    assert isinstance(e, ImportError); print(e)\n")
    assert p.returncode == 0, p.stderr
    assert f"pip install 'hurraykv[{extra}]'" in p.stdout and missing in p.stdout
