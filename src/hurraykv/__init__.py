"""hurraykv: the block-paged layout of the Hurray tensor format, for PagedAttention KV caches.

Entry points::

    snapshot = hurraykv.load_snapshot("batch.hrry")       # lazy, mmap-backed
    key, value = snapshot.layer(0)                         # BlockPagedTensor views
    hurraykv.save_snapshot(snapshot, "copy.hrry")          # atomic
    hurraykv.write_snapshot_stream(snapshot, pipe)         # the streaming format
    snapshot = hurraykv.read_snapshot_stream(pipe)

    desc = hurraykv.decode_descriptor(data)                # bytes -> TensorDescriptor
    data = desc.encode()                                   # TensorDescriptor -> bytes

The top level holds task-level names: snapshots, tensors, files, streams, the client,
server and store, descriptors and the errors.  Wire helpers (element types, layouts,
buffer handles, sub-byte ``pack``/``unpack``) live in :mod:`hurraykv.wire`; the ones the
top level used to export still resolve here, with a DeprecationWarning.
"""

import warnings as _warnings

from . import wire
from .errors import (
    BufferError,  # deprecated alias of HurrayBufferError (shadows the builtin)
    ConfigError,
    ContainerError,
    DescriptorError,
    ElementTypeError,
    HurrayBufferError,
    HurrayError,
    LayoutError,
    MissingDependencyError,
    PermissiveAccessError,
    QuantizationError,
    RemoteError,
    SeqLensRequiredError,
    SnapshotError,
    StoreError,
    StreamError,
    TransportError,
    UnsupportedError,
)
from .io.checksums import ChecksumError
from .io.hrry import HrryFile
from .io.snapshots import load_snapshot, read_snapshot_sequential, save_snapshot
from .io.stream import (
    SnapshotStreamReader,
    SnapshotStreamWriter,
    read_snapshot_stream,
    write_snapshot_stream,
)
from .paged import BlockPagedTensor
from .snapshot import KVCacheSnapshot
from .wire import TensorDescriptor, decode_descriptor

__version__ = "0.1.0"

# The network client and server and the Redis store, imported on first use so that
# ``import hurraykv`` needs neither redis nor torch.
_LAZY = {"KVClient": "net.client", "KVServer": "net.server", "PageStore": "store"}
# Wire helpers once exported here: import them from hurraykv.wire.
_MOVED = {"ELEMENT_TYPES", "BlockPaged", "BufferHandle", "ElementType", "element_type",
          "pack", "unpack"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _MOVED:
        _warnings.warn(f"hurraykv.{name} is deprecated: import it from hurraykv.wire",
                       DeprecationWarning, stacklevel=2)
        return getattr(wire, name)
    raise AttributeError(f"module 'hurraykv' has no attribute {name!r}")


__all__ = [
    "BlockPagedTensor",
    "BufferError",
    "ChecksumError",
    "ConfigError",
    "ContainerError",
    "DescriptorError",
    "ElementTypeError",
    "HrryFile",
    "HurrayBufferError",
    "HurrayError",
    "KVCacheSnapshot",
    "KVClient",
    "KVServer",
    "LayoutError",
    "MissingDependencyError",
    "PageStore",
    "PermissiveAccessError",
    "QuantizationError",
    "RemoteError",
    "SeqLensRequiredError",
    "SnapshotError",
    "SnapshotStreamReader",
    "SnapshotStreamWriter",
    "StoreError",
    "StreamError",
    "TensorDescriptor",
    "TransportError",
    "UnsupportedError",
    "decode_descriptor",
    "load_snapshot",
    "read_snapshot_sequential",
    "read_snapshot_stream",
    "save_snapshot",
    "write_snapshot_stream",
]
