"""hurraykv: the block-paged layout of the Hurray tensor format, for PagedAttention KV caches.

Three entry points cover most uses::

    desc = hurraykv.decode_descriptor(data)          # bytes -> TensorDescriptor
    data = desc.encode()                             # TensorDescriptor -> bytes
    t = hurraykv.BlockPagedTensor.from_descriptor(desc, buffers, seq_lens)
"""

from .errors import (
    BufferError,
    DescriptorError,
    ElementTypeError,
    HurrayError,
    LayoutError,
    PermissiveAccessError,
    QuantizationError,
    SeqLensRequiredError,
    UnsupportedError,
)
from .paged import BlockPagedTensor
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

__all__ = [
    "ELEMENT_TYPES", "BlockPaged", "BlockPagedTensor", "BufferError", "BufferHandle",
    "DescriptorError", "ElementType", "ElementTypeError", "HurrayError", "LayoutError",
    "PermissiveAccessError", "QuantizationError", "SeqLensRequiredError", "TensorDescriptor",
    "UnsupportedError", "decode_descriptor", "element_type", "pack", "unpack",
]
