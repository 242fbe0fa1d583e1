"""Floor 0: bytes <-> fields.  ``struct`` over ``bytes``/``memoryview``; no data paths."""

from .buffers import BufferHandle
from .descriptor import TensorDescriptor, decode_descriptor, peek_length
from .dtypes import ELEMENT_TYPES, ElementType, element_type, pack, unpack
from .layouts import BlockPaged, Composite, RowMajor

__all__ = [
    "ELEMENT_TYPES", "BlockPaged", "BufferHandle", "Composite", "ElementType", "RowMajor",
    "TensorDescriptor", "decode_descriptor", "element_type", "pack", "peek_length", "unpack",
]
