"""A snapshot's model name and user metadata, carried on every path (decision H69).

Streams and the network transport have no key-value section (only files do), so a
snapshot that has a ``model`` or ``metadata`` carries them in one more group member, the
*info member*: a row-major uint8 vector holding UTF-8 JSON that starts with the bytes
``{"hurraykv.info":1,``::

    {"hurraykv.info":1,"model":"llama-3-8b","metadata":{"engine":"vllm","tp":2}}

It is recognised by those fields and that prefix (never by name or position), written
after ``seq_lens`` and ``kv_scales``, and absent when there is nothing to carry, so a plain
snapshot's bytes are unchanged.  Other Hurray readers see a uint8 tensor.  Metadata
values are strings, numbers, booleans or lists of them (what both JSON and the file
container's KV section hold); keys starting with ``hurraykv.`` are reserved.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .errors import SnapshotError
from .wire.buffers import BufferHandle
from .wire.descriptor import TensorDescriptor
from .wire.layouts import RowMajor

PREFIX = b'{"hurraykv.info":1,'
MAX_BYTES = 1 << 20
RESERVED = "hurraykv."
UINT8 = 0x11
_SCALARS = (str, bool, int, float)


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as a plain dict, or a SnapshotError naming the key and the rule."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise SnapshotError(f"metadata is a {type(metadata).__name__}; it is a dict of "
                            "str keys", field="metadata", value=type(metadata).__name__)
    out = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or key.startswith(RESERVED):
            raise SnapshotError(f"metadata key {key!r}: keys are str and not under the "
                                f"reserved prefix {RESERVED!r}", field="metadata", value=key)
        if isinstance(value, np.generic):
            value = value.item()
        ok = isinstance(value, _SCALARS) or (
            isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value))
        if not ok:
            raise SnapshotError(f"metadata[{key!r}] is a {type(value).__name__}; values are "
                                "str, int, float, bool or lists of them", field="metadata",
                                value=key, rule="values every path can carry")
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def info_member(model: str | None, metadata: dict[str, Any]) -> tuple[TensorDescriptor,
                                                                      list[memoryview]]:
    body = json.dumps({"model": model, "metadata": metadata}, separators=(",", ":"),
                      ensure_ascii=False)
    data = PREFIX + body[1:].encode("utf-8")
    if len(data) > MAX_BYTES:
        raise SnapshotError(f"model and metadata take {len(data)} bytes; at most {MAX_BYTES}",
                            field="metadata", value=len(data))
    return (TensorDescriptor(UINT8, (len(data),), RowMajor(), (BufferHandle(len(data)),)),
            [memoryview(data)])


def text_offset(model: str | None, metadata: dict[str, Any], key: str) -> int | None:
    """Where the text of the string ``metadata[key]`` starts in the bytes of
    ``info_member(model, metadata)``, or None when JSON escapes it (so it is not its text
    verbatim): the entry placed by the member's form and its key, never found by searching
    for the text, which another entry may hold too."""
    value = metadata.get(key)
    if not isinstance(value, str) or json.dumps(value, ensure_ascii=False) != f'"{value}"':
        return None
    keys = list(metadata)
    head = {k: metadata[k] for k in keys[:keys.index(key)]} | {key: ""}
    body = json.dumps({"model": model, "metadata": head}, separators=(",", ":"),
                      ensure_ascii=False)
    # the member's JSON is written in order: up to the value's opening quote it is this
    # one's, which ends with that quote and '"}}'
    return len(PREFIX) + len(body[1:-3].encode("utf-8"))


def is_info(desc: TensorDescriptor) -> bool:
    """The fields of an info member (its prefix is checked by ``parse_info``)."""
    return (desc.type_tag == UINT8 and desc.rank == 1 and isinstance(desc.layout, RowMajor)
            and desc.quantization is None and desc.byte_offset == 0
            and len(PREFIX) <= desc.shape[0] <= MAX_BYTES
            and len(desc.buffers) == 1 and desc.buffers[0].byte_size == desc.shape[0])


def parse_info(desc: TensorDescriptor, buffers: Any) -> tuple[str | None, dict] | None:
    """``(model, metadata)`` of an info member, or None for a uint8 vector that is not one."""
    if not is_info(desc) or not len(buffers):
        return None
    raw = bytes(memoryview(buffers[0]).cast("B")[:desc.shape[0]])
    if not raw.startswith(PREFIX):
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SnapshotError(f"the info member's JSON does not parse: {e}", field="info",
                            rule="UTF-8 JSON") from None
    model, metadata = doc.get("model"), doc.get("metadata", {})
    if model is not None and not isinstance(model, str):
        raise SnapshotError(f"info member: model is a {type(model).__name__}", field="model",
                            value=model, rule="a string or null")
    return model, check_metadata(metadata)
