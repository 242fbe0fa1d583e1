"""The ``hurraykv`` command line.

    hurraykv inspect [--json] PATH       a descriptor, a stream or a .hrry file
    hurraykv validate [--permissive] PATH
    hurraykv compact IN OUT              keep only referenced pages (.hrry or stream in)
    hurraykv serve [--listen 127.0.0.1:7878] [--memory-budget 8G] [--persist DIR] ...
    hurraykv push ADDRESS KEY FILE.hrry  /  hurraykv pull ADDRESS KEY OUT.hrry

Exit codes: 0 success, 1 the input was rejected (the reason on stderr), 2 usage.
Progress bars go to stderr for work over about a second, unless --quiet or stderr is not
a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import HurrayError, StreamError
from .io.hrry import HrryFile
from .io.snapshots import save_snapshot, snapshot_from_file
from .io.stream import TensorStreamReader
from .paged import BlockPagedTensor
from .snapshot import GROUP, KVCacheSnapshot, member_name
from .wire.annotate import format_rows, layout_fields, quantization_fields, to_json
from .wire.descriptor import TensorDescriptor, decode_descriptor
from .wire.layouts import BlockPaged, Composite, layout_name


class Progress:
    """A one-line progress bar on stderr, shown only after ~1 s and only on a terminal."""

    def __init__(self, label: str, quiet: bool = False) -> None:
        self.label = label
        self.enabled = not quiet and sys.stderr.isatty()
        self.start = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if elapsed < 1.0:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / elapsed / (1 << 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {done / (1 << 30):.2f} GiB "
                         f"{rate:.2f} GiB/s")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def _usage_error(msg: str) -> int:
    print(f"hurraykv: {msg}", file=sys.stderr)
    return 2


class Input:
    """What the user named: a regular file (read lazily, mapped), or standard input and
    any other non-seekable source (``-``, ``/dev/stdin``, a pipe), read once into memory,
    so that sniffing the kind never consumes bytes the reader then misses."""

    def __init__(self, path: str) -> None:
        self.name = "<stdin>" if path == "-" else path
        self.path: str | None = None
        self.data: memoryview | None = None
        try:
            if path == "-":
                self.data = _read_all(sys.stdin.buffer)
            else:
                with open(path, "rb") as f:
                    if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        self.path = path
                    else:
                        self.data = _read_all(f)
        except OSError as e:
            raise SystemExit(_usage_error(f"cannot read {self.name}: {e.strerror}")) from None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else os.path.getsize(self.path)

    def head(self, n: int) -> bytes:
        if self.data is not None:
            return bytes(self.data[:n])
        with open(self.path, "rb") as f:
            return f.read(n)

    def read(self) -> bytes | memoryview:
        return self.data if self.data is not None else Path(self.path).read_bytes()

    def hrry(self) -> HrryFile:
        if self.data is not None:
            return HrryFile.from_bytes(self.data, self.name)
        return HrryFile.open(self.path)

    def stream(self) -> BinaryIO:
        return io.BytesIO(self.data) if self.data is not None else open(self.path, "rb")

    @property
    def kind(self) -> str:
        head = self.head(10)
        if head[:8] == b"HRRYFILE":
            return "hrry"
        if len(head) == 10 and head[:4] == b"HRRY":
            length = int.from_bytes(head[6:10], "little")
            if 20 <= length < self.size:
                return "stream"  # bytes follow the first descriptor: buffers, more tensors
        return "descriptor"  # one descriptor, or let the decoder say what is wrong with it


def _read_all(f: BinaryIO) -> memoryview:
    """Everything ``f`` yields, in one growing buffer (memory follows the bytes that come)."""
    buf = bytearray(1 << 16)
    got = 0
    while True:
        if got == len(buf):
            bigger = bytearray(2 * len(buf))
            bigger[:got] = buf
            buf = bigger
        n = f.readinto(memoryview(buf)[got:])
        if not n:
            return memoryview(buf)[:got]
        got += n


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _tensor_row(name: str | None, desc: TensorDescriptor) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name, "element_type": desc.element_type_name, "shape": list(desc.shape),
        "layout": layout_name(desc.layout_tag), "bytes": sum(h.byte_size for h in desc.buffers),
    }
    if isinstance(desc.layout, BlockPaged):
        row |= {"layer": desc.layout.layer_index, "kv_role": desc.layout.kv_role_name}
    if desc.quantization is not None:
        row["quantization"] = quantization_fields(desc)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["name", "layer", "kv_role", "element_type", "shape", "pages_referenced",
            "pages_shared", "bytes"]
    head = ["name", "layer", "role", "dtype", "shape", "pages", "shared", "bytes"]
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def _snapshot_rows(snap: KVCacheSnapshot) -> list[dict[str, Any]]:
    rows = []
    for layer, role in snap.member_keys():
        t = snap.tensor(layer, role)
        rows.append(_tensor_row(member_name(layer, role), t.descriptor()) | {
            "num_pages": t.num_pages, "pages_referenced": len(t.referenced_pages),
            "pages_shared": len(t.shared_pages)})
    return rows


@dataclass
class Contents:
    """What an input holds: one descriptor, a KV snapshot, or standalone tensors."""

    kind: str  # "descriptor", "hrry" or "stream"
    desc: TensorDescriptor | None = None
    snapshot: KVCacheSnapshot | None = None
    tensors: list[tuple[str | None, TensorDescriptor, Any]] = field(default_factory=list)
    file: HrryFile | None = None


def _torn_head(desc: TensorDescriptor) -> str:
    """Why a lone descriptor is a cut stream: a composite head whose members never came."""
    layout = desc.layout
    if isinstance(layout, Composite) and layout.member_count:
        return (f"a composite head announcing {layout.member_count} members, and none "
                "follow: as a stream this is truncated")
    return ""


def _is_group(desc: TensorDescriptor) -> bool:
    return isinstance(desc.layout, Composite) and desc.layout.rule == GROUP


def _has_block_paged(descs: list[TensorDescriptor]) -> bool:
    return any(isinstance(d.layout, BlockPaged) for d in descs)


def load_contents(inp: Input, permissive: bool = False) -> Contents:
    """Read an input once.  A group whose members include block-paged tensors is a KV
    snapshot and held to the snapshot rules; anything else is a set of tensors, each
    held to its own rules."""
    kind = inp.kind
    if kind == "descriptor":
        return Contents(kind, desc=decode_descriptor(inp.read(), strict=not permissive))
    if kind == "hrry":
        f = inp.hrry()
        heads = [n for n in f.names if isinstance(f.descriptor(n).layout, Composite)]
        if any(_is_group(f.descriptor(h)) and _has_block_paged(
                [f.descriptor(m) for m in f.members(h)]) for h in heads):
            return Contents(kind, snapshot=snapshot_from_file(f), file=f)
        return Contents(kind, tensors=[(n, f.descriptor(n), f.buffers(n)) for n in f.names
                                       if n not in heads], file=f)
    with inp.stream() as fh:
        items = list(TensorStreamReader(fh))
    if (len(items) == 1 and _is_group(items[0].desc)
            and _has_block_paged([m.desc for m in items[0].members])):
        return Contents(kind, snapshot=KVCacheSnapshot.from_members(
            [(None, m.desc, m.buffers) for m in items[0].members]))
    flat: list[tuple[str | None, TensorDescriptor, Any]] = []

    def walk(item: Any) -> None:
        if not isinstance(item.desc.layout, Composite):
            flat.append((None, item.desc, item.buffers))
        for m in item.members:
            walk(m)

    for item in items:
        walk(item)
    return Contents(kind, tensors=flat)


def _check_tensors(contents: Contents) -> list[BlockPagedTensor | None]:
    """Each standalone block-paged tensor built (index invariants; lengths per D6)."""
    return [BlockPagedTensor.from_descriptor(d, b) if isinstance(d.layout, BlockPaged)
            else None for _, d, b in contents.tensors]


def cmd_inspect(args: argparse.Namespace) -> int:
    inp = Input(args.path)
    contents = load_contents(inp, args.permissive)
    if contents.desc is not None:
        desc = contents.desc
        if args.json:
            print(json.dumps(to_json(desc), indent=2))
        else:
            print(_summary(desc))
            if _torn_head(desc):
                print(f"  note         : {_torn_head(desc)}")
            print()
            print(format_rows(desc))
        return 0
    snap, f = contents.snapshot, contents.file
    if snap is not None:
        rows = _snapshot_rows(snap)
    else:
        rows = []
        for (name, desc, _), t in zip(contents.tensors, _check_tensors(contents), strict=True):
            row = _tensor_row(name, desc)
            if t is not None:
                row |= {"num_pages": t.num_pages, "pages_referenced": len(t.referenced_pages),
                        "pages_shared": len(t.shared_pages)}
            rows.append(row)
    out: dict[str, Any] = {"kind": contents.kind, "snapshot": snap is not None,
                           "tensors": rows}
    if f is not None:
        out |= {"kv": {k: _jsonable(v) for k, v in f.kv.items()},
                "data_buffer_alignment": f.alignment}
    if snap is not None:
        out |= {"num_layers": snap.num_layers, "num_seqs": snap.num_seqs,
                "seq_lens": _jsonable(snap.seq_lens), "page_size": snap.page_size,
                "num_kv_heads": snap.num_kv_heads, "head_dim": snap.head_dim,
                "dtype": snap.dtype, "model": snap.model,
                "kv_scales": _jsonable(snap.kv_scales)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    title = f"{inp.name}: {out['kind']}"
    title += f", {snap!r}" if snap is not None else f", {len(rows)} tensors, no KV snapshot"
    print(title)
    print(_table(rows))
    for k, v in out.get("kv", {}).items():
        print(f"  kv {k} = {v}")
    return 0


def _build_all(snap: KVCacheSnapshot, quiet: bool) -> None:
    """Build every member: validates the index buffers of each (invariants 1-3, D6)."""
    progress = Progress("validating", quiet)
    total, done = max(snap.nbytes, 1), 0
    for key in snap.member_keys():
        t = snap.tensor(*key)
        done += sum(len(b) for b in t.buffers())
        progress(done, total)
    progress.close()


def cmd_validate(args: argparse.Namespace) -> int:
    inp = Input(args.path)
    contents = load_contents(inp, args.permissive)
    if contents.desc is not None:
        desc = contents.desc
        torn = _torn_head(desc)
        if torn:
            raise StreamError(f"{inp.name}: {torn}", field="member_count",
                              value=desc.layout.member_count,
                              rule="a composite closes at its Nth member")
        note = f" (permissive: relaxed {len(desc.relaxed)} rule(s))" if desc.relaxed else ""
        print(f"{inp.name}: valid descriptor{note}")
        return 0
    if contents.snapshot is not None:
        _build_all(contents.snapshot, args.quiet)
        print(f"{inp.name}: valid {contents.kind}, {contents.snapshot!r}")
        return 0
    built = _check_tensors(contents)
    paged = sum(t is not None for t in built)
    print(f"{inp.name}: valid {contents.kind}, {len(built)} tensors ({paged} block-paged), "
          "no KV snapshot")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    contents = load_contents(Input(args.input))
    snap = contents.snapshot
    if snap is None:
        raise SystemExit(_usage_error(f"{args.input} holds no KV snapshot"))
    before = sum(t.num_pages for t in snap.tensors())
    compacted = snap.compact()
    after = sum(t.num_pages for t in compacted.tensors())
    progress = Progress("saving", args.quiet)
    save_snapshot(compacted, args.output, progress=progress)
    progress.close()
    print(f"{args.output}: {after} of {before} pages kept, "
          f"{compacted.nbytes} of {snap.nbytes} bytes")
    return 0


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``64K`` or a plain byte count (binary multiples)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8G or 512M") from None


def _tls(args: argparse.Namespace) -> dict[str, Any]:
    return {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": args.tls_ca}


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .net.server import KVServer, ServerConfig

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServerConfig(listen=args.listen, memory_budget=args.memory_budget,
                          persist=args.persist, max_message_size=args.max_message_size,
                          read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                          max_connections=args.max_connections, store=args.store,
                          zero_unused=not args.no_zero_unused, **_tls(args))
    server = KVServer(config)

    async def run() -> None:
        address = await server.start()
        print(f"hurraykv serve: listening on {address}", flush=True)
        await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


def _client(args: argparse.Namespace):
    from .net.client import KVClient

    return KVClient(args.address, server_hostname=args.server_hostname, **_tls(args))


def cmd_push(args: argparse.Namespace) -> int:
    from .io.snapshots import load_snapshot

    snap = load_snapshot(args.file)
    progress = Progress(f"push {args.key}", args.quiet)
    with _client(args) as client:
        seconds = client.push(args.key, snap, progress=progress)
    progress.close()
    print(f"pushed {args.key}: {snap.nbytes} bytes in {seconds:.3f} s "
          f"({snap.nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    progress = Progress(f"pull {args.key}", args.quiet)
    t0 = time.perf_counter()
    with _client(args) as client:
        snap = client.pull(args.key, progress=progress)
    seconds = time.perf_counter() - t0
    save_snapshot(snap, args.output)
    progress.close()
    print(f"pulled {args.key}: {snap.nbytes} bytes in {seconds:.3f} s "
          f"({snap.nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s) -> {args.output}")
    return 0


def _summary(desc: TensorDescriptor) -> str:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hurraykv", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="show a descriptor, stream or .hrry file")
    i.add_argument("--json", action="store_true", help="one JSON object")
    i.add_argument("--permissive", action="store_true", help="decode permissively")
    i.add_argument("path")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("validate", help="exit 0 when valid, 1 when rejected")
    v.add_argument("--permissive", action="store_true",
                   help="skip what the spec lets a permissive reader skip (descriptors)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.add_argument("path")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compact", help="rewrite a snapshot keeping only referenced pages")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("input")
    c.add_argument("output")
    c.set_defaults(func=cmd_compact)

    def tls(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tls-cert", help="PEM certificate (enables TLS)")
        sp.add_argument("--tls-key", help="PEM private key of --tls-cert")
        sp.add_argument("--tls-ca", help="PEM CA bundle; the server then requires client "
                        "certificates whose subject scopes the keys (mutual TLS)")

    sv = sub.add_parser("serve", help="run a KV cache server")
    sv.add_argument("--listen", default="127.0.0.1:7878",
                    help="HOST:PORT or a Unix socket path (default loopback 127.0.0.1:7878)")
    sv.add_argument("--memory-budget", type=parse_size, default=None,
                    help="bytes kept in memory, LRU beyond (e.g. 8G)")
    sv.add_argument("--persist", help="directory: each committed snapshot as a .hrry file")
    sv.add_argument("--store", help="backing tier: redis://HOST:PORT or "
                    "redis+cluster://HOST:PORT (pages stored once, shared by servers)")
    sv.add_argument("--max-message-size", type=parse_size, default=16 << 20)
    sv.add_argument("--read-timeout", type=float, default=30.0)
    sv.add_argument("--idle-timeout", type=float, default=600.0)
    sv.add_argument("--max-connections", type=int, default=256)
    sv.add_argument("--no-zero-unused", action="store_true",
                    help="do not zero unused page slots before data leaves the process")
    sv.add_argument("--log-level", default="info")
    tls(sv)
    sv.set_defaults(func=cmd_serve)
    for name, helptext in (("push", "push a .hrry snapshot to a server"),
                           ("pull", "pull a snapshot from a server into a .hrry file")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("address", help="HOST:PORT or a Unix socket path")
        sp.add_argument("key")
        sp.add_argument("file" if name == "push" else "output")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.add_argument("--server-hostname", help="TLS server name to verify")
        tls(sp)
        sp.set_defaults(func=cmd_push if name == "push" else cmd_pull)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OSError as e:  # a socket or file the user named
        print(f"hurraykv: {e}", file=sys.stderr)
        return 1
    except HurrayError as e:
        where = (getattr(args, "path", None) or getattr(args, "input", None)
                 or getattr(args, "address", ""))
        print(f"hurraykv: {where}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
