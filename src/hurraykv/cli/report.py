"""``hurraykv inspect``: what a descriptor, stream or .hrry file holds, in numbers a KV
cache engineer reads first (tokens, pages in the pool against pages referenced and
shared, bytes, what ``compact`` would save), then one row per member with identical
layers collapsed.  ``--json`` prints every number, uncollapsed."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .. import units
from ..integrations.vllm.groups import METADATA_KEY as GROUPS_KEY
from ..integrations.vllm.groups import STATE_KEY as STATES_KEY
from ..io import checksums
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot, member_name
from ..wire.annotate import quantization_fields
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged, layout_name


def member_row(name: str | None, desc: TensorDescriptor,
               t: BlockPagedTensor | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name, "element_type": desc.element_type_name, "shape": list(desc.shape),
        "layout": layout_name(desc.layout_tag), "bytes": sum(h.byte_size for h in desc.buffers),
    }
    if isinstance(desc.layout, BlockPaged):
        row |= {"layer": desc.layout.layer_index, "kv_role": desc.layout.kv_role_name}
    if desc.quantization is not None:
        row["quantization"] = quantization_fields(desc)
    if t is not None:
        q = desc.quantization
        paged = [desc.buffers[0].byte_size] + ([h.byte_size for h in desc.buffers[3:]]
                                               if q is not None and q.per_slot else [])
        referenced = len(t.referenced_pages)
        per_page = sum(paged) / t.num_pages if t.num_pages else 0
        row |= {"num_pages": t.num_pages, "pages_referenced": referenced,
                "pages_shared": len(t.shared_pages),
                "compact_saves": round(per_page * (t.num_pages - referenced))}
    return row


def snapshot_rows(snap: KVCacheSnapshot) -> list[dict[str, Any]]:
    """The block-paged members, then the others (a hybrid model's states)."""
    return [member_row(member_name(layer, role), snap.descriptor(layer, role),
                       snap.tensor(layer, role)) for layer, role in snap.member_keys()] + [
        member_row(name, desc) for name, desc, _ in snap.extras]


def group_lines(snap: KVCacheSnapshot) -> list[str]:
    """A hybrid model's KV cache groups (a vLLM connector segment's group map:
    ``integrations/vllm/groups.py``), one line each."""
    try:
        found = json.loads(snap.metadata.get(GROUPS_KEY, "null"))
        groups = found["groups"]
    except (TypeError, ValueError, KeyError):
        return []
    lines = [f"  KV cache groups ({len(groups)}, block size {found.get('block_size')}"
             f"{', end states stored' if snap.metadata.get(STATES_KEY) is True else ''}):"]
    for g in groups:
        kind = g.get("kind", "?") + (f" {g['window']} tokens" if "window" in g else "")
        members = "states" if g.get("kind") == "mamba" else "layers"
        states = "".join(f", state {k}: {s['dtype']} {s['shape']}"
                         for k, s in enumerate(g.get("states", ())))
        lines.append(f"    {kind:<22} {members}.{','.join(map(str, g.get('members', ())))}"
                     f" ({len(g.get('layers', ()))} model layers{states})")
    return lines


def seq_summary(lens: np.ndarray) -> dict[str, Any]:
    if not len(lens):
        return {"count": 0}
    return {"count": len(lens), "tokens": int(lens.sum()), "min": int(lens.min()),
            "median": float(np.median(lens)), "max": int(lens.max())}


def totals(rows: list[dict[str, Any]], file_size: int | None) -> dict[str, Any]:
    paged = [r for r in rows if "num_pages" in r]
    out: dict[str, Any] = {"bytes": sum(r["bytes"] for r in rows)}
    if paged:
        out |= {"pages_in_pools": sum(r["num_pages"] for r in paged),
                "pages_referenced": sum(r["pages_referenced"] for r in paged),
                "pages_shared": sum(r["pages_shared"] for r in paged),
                "compact_saves": sum(r["compact_saves"] for r in paged),
                "pools": len(paged)}
        same = {(r["num_pages"], r["pages_referenced"], r["pages_shared"]) for r in paged}
        if len(same) == 1 and len(paged) > 1:
            n, ref, shared = same.pop()
            out["per_pool"] = {"num_pages": n, "pages_referenced": ref, "pages_shared": shared}
    if file_size is not None:
        out["file_size"] = file_size
    return out


# ---------------------------------------------------------------------------- text
def collapse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of consecutive layers that are identical but for the layer index become one
    ``layers.A-B.role`` row (``count`` members, each with the shown numbers)."""
    keys = ("kv_role", "element_type", "shape", "layout", "bytes", "num_pages",
            "pages_referenced", "pages_shared", "quantization")
    out: list[dict[str, Any]] = []
    runs: dict[str, dict[str, Any]] = {}  # role -> the row its next layer may join
    for row in rows:
        role, layer = row.get("kv_role"), row.get("layer")
        last = runs.get(role) if role is not None else None
        if last is not None and layer == last["_last"] + 1 and all(
                last.get(k) == row.get(k) for k in keys):
            last["_last"], last["count"] = layer, last["count"] + 1
            continue
        row = dict(row, count=1, _last=layer)
        out.append(row)
        if role is not None and layer is not None:
            runs[role] = row
    for row in out:
        first, last = row.get("layer"), row.pop("_last")
        if row["count"] > 1:
            row["name"] = f"layers.{first}-{last}.{row['kv_role']}"
    return out


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("name", "name"), ("element_type", "dtype"), ("shape", "shape"),
            ("num_pages", "pool pages"), ("pages_referenced", "referenced"),
            ("pages_shared", "shared"), ("bytes", "bytes")]
    cells = []
    for r in rows:
        line = []
        for key, _ in cols:
            v = r.get(key)
            if key == "bytes":
                v = units.size(v) + (" each" if r.get("count", 1) > 1 else "")
            elif isinstance(v, int) and key != "layer":
                v = units.count(v)
            line.append("-" if v is None else str(v))
        cells.append(line)
    heads = [h for _, h in cols]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip()
              for cell in cells]
    return "\n".join(lines)


def quantization_text(desc: TensorDescriptor) -> str | None:
    """``per_block_affine int4, symmetric, float32 scales per page slot`` or None."""
    q = quantization_fields(desc)
    if q is None:
        return None
    per = {"per_block_affine": "per page slot", "per_channel": f"along axis {q.get('axis')}",
           "per_tensor": "one"}.get(q["scheme"], "")
    sym = "" if "symmetric" not in q else (", symmetric" if q["symmetric"] else
                                           ", with zero-points")
    scales = f", {q['scale_type']} scales {per}".rstrip() if "scale_type" in q else ""
    return f"{q['scheme']} {desc.element_type_name}{sym}{scales}"


def scales_text(kv_scales: np.ndarray) -> str:
    rows = {tuple(r) for r in kv_scales.tolist()}
    if len(rows) == 1:
        k, v = rows.pop()
        return f"k_scale {k:g}, v_scale {v:g} on every layer"
    return "; ".join(f"layer {i}: k {k:g} v {v:g}" for i, (k, v) in
                     enumerate(kv_scales.tolist()))


def _pages(tot: dict[str, Any]) -> str:
    """Pool pages against referenced and shared ones, per pool when the pools agree (the
    usual case: every layer of one engine)."""
    per = tot.get("per_pool")
    n, ref, shared = ((per["num_pages"], per["pages_referenced"], per["pages_shared"]) if per
                      else (tot["pages_in_pools"], tot["pages_referenced"],
                            tot["pages_shared"]))
    where = f"in each of {tot['pools']} pools" if per else "in the pools"
    return (f"{units.count(n)} {where}, {units.count(ref)} referenced "
            f"({units.count(shared)} shared), {units.count(n - ref)} unused")


def summary_lines(snap: KVCacheSnapshot | None, tot: dict[str, Any]) -> list[str]:
    lines = []
    if snap is not None:
        s = seq_summary(snap.seq_lens)
        seqs = f"{s['count']}" if not s["count"] else (
            f"{s['count']}, {units.plural(s['tokens'], 'token')} (min {s['min']}, median "
            f"{s['median']:g}, max {s['max']})")
        lines.append(f"  sequences   : {seqs}")
    if "pages_in_pools" in tot:
        lines.append(f"  pages       : {_pages(tot)}")
    size = f"  bytes       : {units.size(tot['bytes'])} of tensor data"
    if "file_size" in tot:
        size += f", file {units.size(tot['file_size'])}"
    lines.append(size)
    if tot.get("compact_saves"):
        share = tot["compact_saves"] / max(tot["bytes"], 1)
        lines.append(f"  compact     : would save {units.size(tot['compact_saves'])} "
                     f"({share:.1%}): `hurraykv compact IN OUT` keeps referenced pages only")
    if snap is not None and snap.kv_scales is not None:
        lines.append(f"  fp8 scales  : {scales_text(snap.kv_scales)}")
    if snap is not None:
        schemes = {quantization_text(snap.descriptor(*k)) for k in snap.member_keys()}
        schemes.discard(None)
        if schemes:
            lines.append(f"  quantization: {'; '.join(sorted(schemes))}")
    if snap is not None and snap.model is not None:
        lines.append(f"  model       : {snap.model}")
    groups = group_lines(snap) if snap is not None else []
    lines += groups
    shown = {k: v for k, v in (snap.metadata if snap is not None else {}).items()
             if not (k == GROUPS_KEY and groups)}  # the group map is shown above
    if checksums.KEY in shown:  # 16 hex digits a page: a count says what they are for
        digests = str(shown.pop(checksums.KEY))
        lines.append(f"  checksums   : xxh3-64 of {units.count(len(digests) // 16)} pieces "
                     "(pages and buffers); `hurraykv validate` checks them")
    if shown:
        lines.append("  metadata    : " + ", ".join(f"{k} = {v}" for k, v in shown.items()))
    return lines


def seq_lines(snap: KVCacheSnapshot, limit: int = 8) -> list[str]:
    """Each sequence: tokens, pages and its block table (of the first member)."""
    t = snap.tensor(*snap.member_keys()[0])
    lines = ["  seq  tokens  pages  block table"]
    ptr = t.seq_ptr.astype(np.int64)
    for s, n in enumerate(snap.seq_lens.tolist()):
        pages = t.block_table[ptr[s]:ptr[s + 1]].tolist()
        shown = ", ".join(map(str, pages[:limit])) + (", ..." if len(pages) > limit else "")
        lines.append(f"  {s:<4} {n:<7} {len(pages):<6} [{shown}]")
    return lines
