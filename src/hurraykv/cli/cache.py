"""``hurraykv cache ls URL`` and ``hurraykv cache clear URL (--identity ID | --all)``: what
a connector's store holds (``file://``, ``hurray://``, ``redis://``), per cache identity,
and its removal.

An identity is named by its key, the 32 hex digits ``cache ls`` prints (a prefix of them
that only one identity starts with will do), or by the whole identity string the
connector logs at start (``identity model=...;...``).  ``clear`` lists the store again
after removing: it fails (exit 1) when a segment it removed is still there."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .. import units
from ..errors import HurrayError
from .inputs import CannotRead

TLS = ("tls_cert", "tls_key", "tls_ca", "server_hostname")


def add_parsers(sub: Any) -> None:
    cache = sub.add_parser("cache", help="what a connector's store holds, per cache "
                           "identity, and its removal (file://, hurray://, redis://)")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    ls = csub.add_parser("ls", help="per identity: segments, bytes, oldest, last use")
    ls.add_argument("--segments", action="store_true", help="one line per segment too")
    cl = csub.add_parser("clear", help="remove every segment of one identity (or all)")
    which = cl.add_mutually_exclusive_group(required=True)
    which.add_argument("--identity", metavar="ID", help="its key as `cache ls` prints "
                       "it (or a prefix only it starts with), or the identity string")
    which.add_argument("--all", action="store_true", help="every segment, of every "
                       "identity")
    for p, func in ((ls, cmd_cache_ls), (cl, cmd_cache_clear)):
        p.add_argument("url", help="file:///DIR, hurray://HOST:PORT or redis://HOST:PORT")
        p.add_argument("--json", action="store_true", help="the answer as one JSON object")
        for opt in TLS:
            p.add_argument("--" + opt.replace("_", "-"), dest=opt,
                           help="for a hurray:// server with mutual TLS")
        p.set_defaults(func=func)


def _open(args: argparse.Namespace) -> Any:
    from urllib.parse import unquote, urlparse

    from ..integrations.chunks import open_store

    parsed = urlparse(args.url)
    if parsed.scheme == "file" and parsed.path.startswith("/") and not os.path.isdir(
            unquote(parsed.path)):  # opening one makes it: not for a typo
        raise CannotRead(f"{args.url}: no such directory")
    return open_store(args.url, timeout=30.0, **{k: getattr(args, k) for k in TLS})


def _summary(segments: list[Any]) -> list[dict[str, Any]]:
    by: dict[Any, dict[str, Any]] = {}
    for s in segments:
        row = by.setdefault(s.identity_key, {
            "identity_key": s.identity_key, "identity": s.identity, "segments": 0,
            "bytes": 0, "oldest": None, "last_used": None})
        row["identity"] = row["identity"] or s.identity
        row["segments"] += 1
        row["bytes"] += s.nbytes
        for field, value, pick in (("oldest", s.created, min), ("last_used", s.used, max)):
            if value is not None:
                row[field] = value if row[field] is None else pick(row[field], value)
    return sorted(by.values(), key=lambda r: -r["bytes"])


def _ago(when: float | None, now: float) -> str:
    if when is None:
        return "-"
    seconds = max(0.0, now - when)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def cmd_cache_ls(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        segments = store.catalog()
    finally:
        store.close()
    rows = _summary(segments)
    if args.json:
        print(json.dumps({"url": args.url, "identities": rows,
                          "segments": [vars(s) for s in segments]}, sort_keys=True))
        return 0
    now = time.time()
    print(f"{'IDENTITY':<32}  {'SEGMENTS':>8}  {'BYTES':>10}  {'OLDEST':>12}  "
          f"{'LAST USE':>12}  IDENTITY STRING")
    for r in rows:
        print(f"{r['identity_key'] or '(none recorded)':<32}  {r['segments']:>8}  "
              f"{units.size(r['bytes']):>10}  {_ago(r['oldest'], now):>12}  "
              f"{_ago(r['last_used'], now):>12}  {r['identity'] or '-'}")
    if args.segments:
        for s in segments:
            print(f"  {s.name}  {units.size(s.nbytes):>10}  {_ago(s.used, now):>12}  "
                  f"{s.identity_key or '-'}")
    print(f"{len(segments)} segments, {units.size(sum(s.nbytes for s in segments))} in "
          f"{args.url}")
    return 0


def _identity(wanted: str, segments: list[Any]) -> str:
    """The identity key ``wanted`` names among those stored: the key, a prefix of only
    one, or the identity string (whose key is computed, stored or not)."""
    from ..integrations.chunks import identity_key

    keys = sorted({s.identity_key for s in segments if s.identity_key})
    if wanted in keys:
        return wanted
    if ";" in wanted or "=" in wanted:  # an identity string, as the connector logs it
        return identity_key(wanted)
    starting = [k for k in keys if k.startswith(wanted.lower())]
    if len(starting) == 1:
        return starting[0]
    known = ", ".join(keys) or "none: the store holds no segment with an identity"
    raise HurrayError(f"--identity {wanted!r} " + (
        f"is a prefix of {len(starting)} identities" if starting else
        "names no identity stored") + f"; stored: {known}", field="identity", value=wanted,
        rule="an identity key `hurraykv cache ls` prints, a prefix only it has, or the "
             "identity string")


def cmd_cache_clear(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        wanted = None if args.all else _identity(args.identity, store.catalog())
        removed = store.clear(wanted)
    finally:
        store.close()
    nbytes = sum(s.nbytes for s in removed)
    if args.json:
        print(json.dumps({"url": args.url, "identity_key": wanted, "removed": len(removed),
                          "bytes": nbytes}, sort_keys=True))
    else:
        print(f"removed {len(removed)} segments ({units.size(nbytes)}) of "
              f"{'every identity' if wanted is None else 'identity ' + wanted} from "
              f"{args.url}", file=sys.stdout)
    return 0


__all__ = ["add_parsers", "cmd_cache_clear", "cmd_cache_ls"]
