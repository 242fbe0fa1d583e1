"""``inspect``, ``validate`` and ``compact``: files, streams and descriptors on disk."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from .. import units
from ..errors import HurrayError, StreamError
from ..io import checksums
from ..io.atomic import write_bytes
from ..io.checksums import ChecksumError
from ..io.snapshots import save_snapshot
from ..snapshot import KVCacheSnapshot
from ..wire.annotate import format_rows, layout_fields, to_json
from ..wire.descriptor import TensorDescriptor
from .blockmap import render as render_map
from .inputs import CannotRead, Input, check_tensors, load_contents, torn_head
from .outputs import STDOUT, check_output, check_writable, human, write_output
from .progress import Progress
from .report import (
    collapse,
    member_row,
    seq_lines,
    seq_summary,
    snapshot_rows,
    summary_lines,
    table,
    totals,
)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def descriptor_summary(desc: TensorDescriptor) -> str:
    lines = [
        f"Hurray descriptor v{desc.version_major}.{desc.version_minor}, "
        f"{len(desc.encode())} bytes",
        f"  element type : {desc.element_type_name} (0x{desc.type_tag:02x})",
        f"  shape        : {list(desc.shape)}",
        f"  layout       : {layout_fields(desc)}",
        f"  buffers      : {[h.byte_size for h in desc.buffers]} bytes",
    ]
    if desc.quantization is not None:
        lines.append(f"  quantization : {desc.quantization}")
    if desc.relaxed:
        lines.append("  relaxed (permissive): " + "; ".join(desc.relaxed))
    return "\n".join(lines)


def rejected_json(path: str, e: Exception) -> str:
    """What ``--json`` prints on stdout for an input that was rejected or cannot be read
    (the usual line still goes to stderr, with the usual exit code)."""
    return json.dumps({"path": "<stdin>" if path == "-" else path, "valid": False,
                       "error": {"type": type(e).__name__, "message": str(e),
                                 "field": getattr(e, "field", None)}}, sort_keys=True)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        return _inspect(args)
    except (HurrayError, CannotRead) as e:
        if args.json:  # an object on stdout for scripts, as validate --json prints
            print(rejected_json(args.path, e))
        raise


def _inspect(args: argparse.Namespace) -> int:
    inp = Input(args.path)
    contents = load_contents(inp, args.permissive)
    if contents.desc is not None:
        desc = contents.desc
        if args.json:
            print(json.dumps(to_json(desc), indent=2))
        else:
            print(descriptor_summary(desc))
            if torn_head(desc):
                print(f"  note         : {torn_head(desc)}")
            print()
            print(format_rows(desc))
        return 0
    snap, f = contents.snapshot, contents.file
    if snap is not None:
        rows = snapshot_rows(snap)
    else:
        rows = [member_row(name, desc, t) for (name, desc, _), t in
                zip(contents.tensors, check_tensors(contents), strict=True)]
    file_size = inp.size if contents.kind == "hrry" else None
    tot = totals(rows, file_size)
    if args.map:
        _write_map(args.map, snap, contents, inp.name)
    if args.json:
        out: dict[str, Any] = {"kind": contents.kind, "snapshot": snap is not None,
                               "totals": tot, "tensors": rows}
        if f is not None:
            out |= {"kv": {k: _jsonable(v) for k, v in f.kv.items()},
                    "data_buffer_alignment": f.alignment}
        if snap is not None:
            out |= {"num_layers": snap.num_layers, "num_seqs": snap.num_seqs,
                    "seq_lens": _jsonable(snap.seq_lens),
                    "seq_summary": seq_summary(snap.seq_lens),
                    "page_size": snap.page_size, "num_kv_heads": snap.num_kv_heads,
                    "head_dim": snap.head_dim, "head_dim_v": snap.head_dim_v,
                    "dtype": snap.dtype, "model": snap.model, "metadata": snap.metadata,
                    "kv_scales": _jsonable(snap.kv_scales)}
        print(json.dumps(out, indent=2))
        return 0
    kind = {"hrry": ".hrry file", "stream": "stream"}[contents.kind]
    print(f"{inp.name}: {kind}, " + (f"{snap!r}" if snap is not None else
                                     f"{len(rows)} tensors, no KV snapshot"))
    for line in summary_lines(snap, tot):
        print(line)
    if snap is not None and args.seqs:
        print()
        print("\n".join(seq_lines(snap)))
    print()
    print(table(collapse(rows)))
    if f is not None:
        other = {k: v for k, v in f.kv.items() if not k.startswith("hurraykv.")}
        if snap is None and other:
            print("  kv: " + ", ".join(f"{k} = {_jsonable(v)}" for k, v in other.items()))
    if args.map:
        print(f"\nblock table map: {args.map}")
    return 0


def _write_map(path: str, snap: KVCacheSnapshot | None, contents: Any, name: str) -> None:
    if snap is not None:
        layer, role = snap.member_keys()[0]
        t, lens, title = snap.tensor(layer, role), snap.seq_lens, f"{name} layers.{layer}.{role}"
    else:
        built = [(n, t) for (n, _, _), t in zip(contents.tensors, check_tensors(contents),
                                                strict=True) if t is not None]
        if not built:
            raise CannotRead(f"{name} holds no block-paged tensor to map")
        n, t = built[0]
        lens, title = t.seq_lens, f"{name} {n or 'tensor 0'}"
    svg = render_map(t, lens, title)
    check_writable(path)
    write_bytes(path, svg.encode("utf-8"))  # O_EXCL | O_NOFOLLOW temporary, then rename


def _build_all(snap: KVCacheSnapshot, quiet: bool) -> None:
    """Build every member: validates the index buffers of each (invariants 1-3, D6)."""
    progress = Progress("validating", quiet)
    total, done = max(snap.nbytes, 1), 0
    for key in snap.member_keys():
        t = snap.tensor(*key)
        done += sum(len(b) for b in t.buffers())
        progress(done, total)
    progress.close()


NO_CHECKSUMS = ("no checksums: values not verified; save_snapshot writes them by default "
                "(checksums=True to insist, up to about 65,000 pages)")


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        verdict = _validate(args)
    except (HurrayError, CannotRead) as e:
        if args.json:  # the verdict on stdout, then the usual line on stderr and exit code
            print(rejected_json(args.path, e))
        raise
    if args.json:
        print(json.dumps(verdict, sort_keys=True))
    elif not args.quiet:
        print(verdict["summary"])
    return 0


def _validate(args: argparse.Namespace) -> dict[str, Any]:
    """The verdict on a valid input (a rejection raises): path, valid, kind, snapshot,
    checksums ("verified", "absent", or None where a kind has none), summary."""
    inp = Input(args.path)
    contents = load_contents(inp, args.permissive)
    verdict: dict[str, Any] = {"path": inp.name, "valid": True, "kind": contents.kind,
                               "snapshot": contents.snapshot is not None, "checksums": None}
    if contents.desc is not None:
        desc = contents.desc
        torn = torn_head(desc)
        if torn:
            raise StreamError(f"{inp.name}: {torn}", field="member_count",
                              value=desc.layout.member_count,
                              rule="a composite closes at its Nth member")
        note = f" (permissive: relaxed {len(desc.relaxed)} rule(s))" if desc.relaxed else ""
        return verdict | {"summary": f"{inp.name}: valid descriptor{note}"}
    if contents.snapshot is not None:
        _build_all(contents.snapshot, args.quiet)
        summed = checksums.has_checksums(contents.snapshot)
        if summed:  # a wrong count is not damage
            checksums.check_entry(contents.snapshot, inp.name)
        bad = _damaged(contents.snapshot)
        if bad:
            raise ChecksumError(f"{inp.name}: stored values do not match their checksums: "
                                f"{bad}", field=checksums.KEY, value=bad,
                                rule="stored bytes equal those checksummed when written")
        said = " (every stored value matches its checksum)" if summed else (
            f" ({NO_CHECKSUMS})")
        return verdict | {"checksums": "verified" if summed else "absent",
                          "summary": f"{inp.name}: valid {contents.kind}, "
                                     f"{contents.snapshot!r}{said}"}
    built = check_tensors(contents)
    paged = sum(t is not None for t in built)
    return verdict | {"summary": f"{inp.name}: valid {contents.kind}, "
                                 f"{units.plural(len(built), 'tensor')} ({paged} "
                                 "block-paged), no KV snapshot"}


def _damaged(snap: Any) -> str:
    """Which pages of which members fail their checksums, in a line ("" when none)."""
    if not checksums.has_checksums(snap):
        return ""
    by_member: dict[str, list[str]] = {}
    for member, buf, page in checksums.mismatches(snap):
        by_member.setdefault(member, []).append(f"page {page}" if page is not None
                                                else f"buffer {buf}")
    return "; ".join(f"{m}: {', '.join(where)}" for m, where in by_member.items())


def cmd_compact(args: argparse.Namespace) -> int:
    contents = load_contents(Input(args.input))
    snap = contents.snapshot
    if snap is None:
        raise CannotRead(f"{args.input} holds no KV snapshot")
    check_output(args.output)
    before = sum(t.num_pages for t in snap.tensors())
    compacted = snap.compact()
    after = sum(t.num_pages for t in compacted.tensors())
    progress = Progress("saving", args.quiet)
    write_output(args.output, lambda path: save_snapshot(
        compacted, path, progress=progress, fsync=args.output != STDOUT))
    progress.close()
    if not args.quiet:
        print(f"{'<stdout>' if args.output == STDOUT else args.output}: {units.count(after)} "
              f"of {units.plural(before, 'page')} kept, {units.size(compacted.nbytes)} of "
              f"{units.size(snap.nbytes)}", file=human(args.output))
    return 0
