"""The ``hurraykv`` command line: inspect and validate Hurray descriptors.

Exit codes: 0 success, 1 the input was rejected (the reason on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import HurrayError
from .wire.annotate import format_rows, layout_fields, to_json
from .wire.descriptor import TensorDescriptor, decode_descriptor


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(_usage_error(f"cannot read {path}: {e.strerror}")) from None


def _usage_error(msg: str) -> int:
    print(f"hurraykv: {msg}", file=sys.stderr)
    return 2


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


def cmd_inspect(args: argparse.Namespace) -> int:
    desc = decode_descriptor(_read(args.path), strict=not args.permissive)
    if args.json:
        print(json.dumps(to_json(desc), indent=2))
    else:
        print(_summary(desc))
        print()
        print(format_rows(desc))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    desc = decode_descriptor(_read(args.path), strict=not args.permissive)
    note = f" (permissive: relaxed {len(desc.relaxed)} rule(s))" if desc.relaxed else ""
    print(f"{args.path}: valid{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hurraykv", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="show a descriptor field by field")
    i.add_argument("--json", action="store_true", help="one JSON object (manifest keys)")
    i.add_argument("--permissive", action="store_true", help="decode permissively")
    i.add_argument("path")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("validate", help="exit 0 when valid, 1 when rejected")
    v.add_argument("--permissive", action="store_true",
                   help="skip what the spec lets a permissive reader skip")
    v.add_argument("path")
    v.set_defaults(func=cmd_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HurrayError as e:
        print(f"hurraykv: {args.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
