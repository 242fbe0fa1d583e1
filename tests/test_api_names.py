"""Names kept for compatibility (issue 21): deprecated aliases still work, and warn."""

from __future__ import annotations

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
