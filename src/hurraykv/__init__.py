"""hurraykv: the block-paged layout of the Hurray tensor format, for PagedAttention KV caches.

Entry points::

    snapshot = hurraykv.load_snapshot("batch.hrry")       # lazy, mmap-backed
    key, value = snapshot.layer(0)                         # BlockPagedTensor views
    hurraykv.save_snapshot(snapshot, "copy.hrry")          # atomic
    hurraykv.write_snapshot_stream(snapshot, pipe)         # the streaming format
    snapshot = hurraykv.read_snapshot_stream(pipe)

    desc = hurraykv.decode_descriptor(data)                # bytes -> TensorDescriptor
    data = desc.encode()                                   # TensorDescriptor -> bytes
"""

from .errors import (
    BufferError,
    ContainerError,
    DescriptorError,
    ElementTypeError,
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
from .wire import (
    ELEMENT_TYPES,
    BlockPaged,
    BufferHandle,
    ElementType,
    TensorDescriptor,
    decode_descriptor,
    element_type,
    pack,
    unpack,
)

__version__ = "0.1.0"

# The network client and server and the Redis store, imported on first use so that
# ``import hurraykv`` needs neither redis nor torch.
_LAZY = {"KVClient": "net.client", "KVServer": "net.server", "PageStore": "store"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hurraykv' has no attribute {name!r}")


__all__ = [
    "ELEMENT_TYPES",
    "BlockPaged",
    "BlockPagedTensor",
    "BufferError",
    "BufferHandle",
    "ContainerError",
    "DescriptorError",
    "ElementType",
    "ElementTypeError",
    "HrryFile",
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
    "element_type",
    "load_snapshot",
    "pack",
    "read_snapshot_sequential",
    "read_snapshot_stream",
    "save_snapshot",
    "unpack",
    "write_snapshot_stream",
]
