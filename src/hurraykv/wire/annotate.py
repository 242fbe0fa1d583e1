"""Field-by-field views of a descriptor: annotated hex rows and a JSON-ready dict.

Both are derived from a decoded ``TensorDescriptor`` by re-encoding its parts, so
they show exactly the bytes ``encode()`` writes, each with its offset and meaning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .buffers import device_name, memory_class_name
from .descriptor import TensorDescriptor
from .layouts import BlockPaged, layout_name
from .quantization import SCALE_TYPES, scheme_name

Row = tuple[int, bytes, str, str]  # offset, bytes, field, meaning

_BUFFER_NAMES = {0: "page_pool", 1: "block_table", 2: "seq_ptr"}


def rows(desc: TensorDescriptor) -> list[Row]:
    data = desc.encode()
    out: list[Row] = []
    pos = 0

    def add(n: int, field: str, meaning: str = "") -> None:
        nonlocal pos
        out.append((pos, data[pos:pos + n], field, meaning))
        pos += n

    add(4, "magic", "HRRY")
    add(1, "version_major", str(desc.version_major))
    add(1, "version_minor", str(desc.version_minor))
    add(4, "descriptor_length", f"{len(data)} bytes")
    add(4, "flags", f"0x{desc.flags:x}")
    add(1, "type_tag", desc.element_type_name)
    add(1, "layout_tag", layout_name(desc.layout_tag))
    add(4, "rank", str(desc.rank))
    dims = ("total_tokens", "num_heads", "head_dim") if desc.is_block_paged else ()
    for i, v in enumerate(desc.shape):
        add(8, f"shape[{i}]", (f"{dims[i]} = " if dims else "") + (
            "dynamic" if v == 0xFFFFFFFFFFFFFFFF else str(v)))
    add(8, "byte_offset", str(desc.byte_offset))
    layout = desc.layout
    if isinstance(layout, BlockPaged):
        add(4, "page_size", f"{layout.page_size} tokens per page")
        add(8, "num_pages", f"{layout.num_pages} pages in the pool")
        add(4, "paged_axis", str(layout.paged_axis))
        add(4, "num_seqs", str(layout.num_seqs))
        add(1, "kv_role", layout.kv_role_name)
        add(4, "layer_index", "not layer-scoped" if layout.layer_index is None
            else str(layout.layer_index))
        add(1, "block_table_index_type", layout.index_type_name)
        add(6, "_reserved", "zero")
    else:
        n = len(layout.encode(desc.rank))
        if n:
            add(n, f"{layout_name(desc.layout_tag)} payload", str(layout_fields(desc)))
    add(1, "buffer_count", str(len(desc.buffers)))
    for i, h in enumerate(desc.buffers):
        name = f"buffers[{i}]"
        role = _BUFFER_NAMES.get(i, "quantization params") if desc.is_block_paged else ""
        add(8, f"{name}.byte_size", f"{role} {h.byte_size} bytes".strip())
        add(4, f"{name}.alignment", str(h.alignment))
        add(1, f"{name}.device_tag", device_name(h.device_tag))
        add(1, f"{name}.sync_mode", str(h.sync_mode))
        add(1, f"{name}.memory_class", memory_class_name(h.memory_class))
        add(1, f"{name}._reserved", "zero")
    if desc.quantization is not None:
        q = desc.quantization.encode()
        add(4, "quantization_length", str(len(q)))
        add(len(q), "quantization", str(quantization_fields(desc)))
    for name, section in (("shard", desc.shard), ("statistics", desc.statistics),
                          ("extension_type", desc.extension_type),
                          ("composite_member", desc.composite_member)):
        if section is not None:
            enc = section.encode(desc.rank) if name == "shard" else section.encode()
            add(len(enc), name, "")
    if desc.trailing:
        add(len(desc.trailing), "trailing", "newer minor version bytes (not interpreted)")
    return out


def format_rows(desc: TensorDescriptor) -> str:
    lines = []
    for off, raw, field, meaning in rows(desc):
        hexed = raw.hex(" ")
        if len(hexed) > 47:
            hexed = hexed[:44] + "..."
        lines.append(f"{off:04x}  {hexed:<47}  {field:<26} {meaning}")
    return "\n".join(lines)


def layout_fields(desc: TensorDescriptor) -> dict[str, Any]:
    layout = desc.layout
    if isinstance(layout, BlockPaged):
        return {
            "page_size": layout.page_size,
            "num_pages": layout.num_pages,
            "paged_axis": layout.paged_axis,
            "num_seqs": layout.num_seqs,
            "kv_role": layout.kv_role_name,
            "layer_index": layout.layer_index,
            "block_table_index_type": layout.index_type_name,
        }
    fields = {k: _jsonable(v) for k, v in dataclasses.asdict(layout).items()}
    return {"name": layout_name(desc.layout_tag), **fields}


def quantization_fields(desc: TensorDescriptor) -> dict[str, Any] | None:
    q = desc.quantization
    if q is None:
        return None
    out: dict[str, Any] = {"scheme": scheme_name(q.TAG), "scheme_tag": q.TAG}
    for k, v in dataclasses.asdict(q).items():
        if k == "scale_type":
            out[k] = SCALE_TYPES.get(v, v)
        elif k not in ("padding", "scheme_tag"):
            out[k] = _jsonable(v)
    if hasattr(q, "symmetric"):
        out["symmetric"] = q.symmetric
    return out


def to_json(desc: TensorDescriptor) -> dict[str, Any]:
    """The reference manifest's ``expect`` keys, plus ``layout``, ``buffers``, ``quantization``."""
    return {
        "version_major": desc.version_major,
        "version_minor": desc.version_minor,
        "element_type_tag": desc.type_tag,
        "element_type": desc.element_type_name,
        "shape": list(desc.shape),
        "byte_offset": desc.byte_offset,
        "layout_tag": desc.layout_tag,
        "buffer_byte_sizes": [h.byte_size for h in desc.buffers],
        "has_quantization": desc.quantization is not None,
        "has_shard": desc.shard is not None,
        "layout": layout_fields(desc),
        "buffers": [h.to_json() for h in desc.buffers],
        "quantization": quantization_fields(desc),
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v
