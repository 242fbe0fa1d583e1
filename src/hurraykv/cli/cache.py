"""``hurraykv cache ls URL``, ``hurraykv cache clear URL (--identity ID | --all)`` and
``hurraykv cache pin URL (--segment NAME | --tokens FILE --identity STRING)``: what a
connector's store holds (``file://``, ``hurray://``, ``redis://``, a store registered from
outside the package), per cache identity, its removal, and its pins and lifetimes (the
operator's side of a request's ``{"hurraykv": {"pin": true, "ttl_s": ...}}``).  The
store's settings are its connector config keys: ``--option max_bytes=64G``, the TLS files
also as ``--tls-cert`` and the like.

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
from pathlib import Path
from typing import Any

from .. import units
from ..errors import ConfigError, HurrayError
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
    pn = csub.add_parser("pin", help="pin segments (never evicted to make room, within "
                         "the store's pinned budget) and/or give them a lifetime")
    what = pn.add_mutually_exclusive_group(required=True)
    what.add_argument("--segment", action="append", metavar="NAME", help="a segment as "
                      "`cache ls --segments` names it (repeat for more)")
    what.add_argument("--tokens", metavar="FILE", help="a prompt's token ids (a JSON list, "
                      "or whitespace-separated; - reads stdin): the segments holding its "
                      "stored prefix, with --identity")
    pn.add_argument("--identity", metavar="STRING", help="with --tokens: the cache identity "
                    "string the connector logs at start (it names the chunk size)")
    pn.add_argument("--salt", help="with --tokens: the requests' cache_salt")
    pn.add_argument("--ttl", type=number, metavar="SECONDS", help="a lifetime: a miss that "
                    "many seconds from now")
    pn.add_argument("--unpin", action="store_true", help="release the pin (with --ttl: "
                    "keep only the lifetime)")
    for p in (cl, pn):
        p.add_argument("-q", "--quiet", action="store_true", help="no summary line (errors "
                       "still go to stderr; the exit code says how it went)")
    for p, func in ((ls, cmd_cache_ls), (cl, cmd_cache_clear), (pn, cmd_cache_pin)):
        p.add_argument("urls", metavar="URL", nargs="+", help="file:///DIR, "
                       "hurray://HOST:PORT, redis://HOST:PORT, s3://BUCKET/PREFIX; several: "
                       "the tiers of a stack, fastest first (each tier takes the options "
                       "its store declares)")
        p.add_argument("--json", action="store_true", help="the answer as one JSON object")
        for opt in TLS:
            p.add_argument("--" + opt.replace("_", "-"), dest=opt,
                           help="for a hurray:// server with mutual TLS")
        p.add_argument("--timeout", type=number, default=30.0, metavar="SECONDS",
                       help="how long to wait for the store to open and answer (default "
                       "30)")
        p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                       help="a setting of the URL's store, as its kv_connector_extra_config "
                       "key (a store from outside the package takes its own; repeat for "
                       "more)")
        p.set_defaults(func=func)


def _open(args: argparse.Namespace) -> Any:
    """The store the URLs name: one, or the stack of them (fastest first), each opened
    with the settings its store declares."""
    from ..chunks.registry import options, store_class
    from ..chunks.settings import Option
    from ..chunks.stack import StackedChunks
    from ..chunks.urls import check_url

    settings = {k: getattr(args, k) for k in TLS if getattr(args, k) is not None}
    for given in args.option:
        name, equals, text = given.partition("=")
        if not equals:
            raise ConfigError(f"--option {given!r} is not NAME=VALUE", field="--option",
                              value=given, rule="NAME=VALUE")
        settings[name] = options().get(name, Option(name)).parse(text, f"--option {name}")
    if not 0 < args.timeout < float("inf"):
        raise ConfigError(f"--timeout {args.timeout:g}: it is a number of seconds above 0",
                          field="--timeout", value=args.timeout, rule="seconds above 0")
    args.url = " > ".join(args.urls)  # for the messages and --json
    if len(args.urls) == 1:
        return _open_one(args.urls[0], settings, args.timeout)
    owns = [set(getattr(store_class(url.partition(":")[0]), "option_names", tuple)())
            for url in args.urls]
    if set(settings) - set().union(*owns):  # nobody's: said as a single store says it
        check_url(args.urls[0], list(settings))
    opened: list[Any] = []
    try:
        for url, own in zip(args.urls, owns, strict=True):
            opened.append(_open_one(url, {k: v for k, v in settings.items() if k in own},
                                    args.timeout))
    except BaseException:
        for store in opened:
            store.close()
        raise
    return StackedChunks(opened, queue_depth=0)


def _open_one(url: str, settings: dict[str, Any], timeout: float) -> Any:
    from urllib.parse import unquote, urlparse

    from ..chunks.registry import is_local, store_class
    from ..chunks.urls import check_url, open_store

    # before the directory check below: a URL of no store is said as such
    check_url(url, list(settings))
    parsed = urlparse(url)
    cls = store_class(parsed.scheme)
    if cls is not None and cls.IN_PROCESS:
        raise ConfigError(f"{url}: a {parsed.scheme}:// pool lives in the memory of the "
                          "engine process that holds it; hurraykv cache, another process, "
                          "cannot reach it (reset_cache through the engine clears it)",
                          field="url", value=url, rule="a store another process reaches")
    if is_local(url) and not os.path.isdir(
            unquote(parsed.path)):  # opening one makes it: not for a typo
        raise CannotRead(f"{url}: no such directory")
    return open_store(url, timeout=timeout, **settings)


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
    from ..chunks.stack import merged

    store = _open(args)
    try:
        if len(args.urls) > 1:  # each tier listed once: the stack's list is theirs
            tiers = list(zip(args.urls, store.catalogs(), strict=True))
            segments = merged([listed for _, listed in tiers])
        else:
            segments, tiers = store.catalog(), []
    finally:
        store.close()
    rows = _summary(segments)
    if args.json:
        print(json.dumps({"url": args.url, "identities": rows,
                          "segments": [vars(s) for s in segments],
                          **({"tiers": [{"url": url, "segments": len(listed),
                                         "bytes": sum(s.nbytes for s in listed)}
                                        for url, listed in tiers]} if tiers else {})},
                         sort_keys=True))
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
            kept = ("pinned" if s.pinned else "") + (
                f" expires in {max(0.0, s.expiry - now):.0f} s" if s.expiry else "")
            print(f"  {s.name}  {units.size(s.nbytes):>10}  {_ago(s.used, now):>12}  "
                  f"{s.identity_key or '-'}  {kept.strip()}")
    for url, listed in tiers:
        print(f"  tier {url}: {units.plural(len(listed), 'segment')}, "
              f"{units.size(sum(s.nbytes for s in listed))}")
    print(f"{units.plural(len(segments), 'segment')}, "
          f"{units.size(sum(s.nbytes for s in segments))} in {args.url}")
    if any(r[k] is None for r in rows for k in ("oldest", "last_used")):
        print(UNRECORDED)
    return 0


# A "-" under OLDEST or LAST USE is not an age too small to show: the store has no such
# time to give (docs/vllm.md, "For operators").
UNRECORDED = ("-: not recorded by this store (file:// keeps each segment's last use, its "
              "modification time, not when it was stored; a hurray:// server keeps "
              "neither)")


def _identity(wanted: str, segments: list[Any]) -> str:
    """The identity key ``wanted`` names among those stored: the key, a prefix of only
    one, or the identity string (whose key is computed, stored or not)."""
    from ..chunks.keys import identity_key

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
    elif not args.quiet:
        print(f"removed {units.plural(len(removed), 'segment')} ({units.size(nbytes)}) of "
              f"{'every identity' if wanted is None else 'identity ' + wanted} from "
              f"{args.url}", file=sys.stdout)
    return 0


def _prefix_names(args: argparse.Namespace, store: Any) -> list[str]:
    """The segments holding the stored prefix of ``--tokens`` under ``--identity``, every
    tensor-parallel rank's."""
    import re
    from types import SimpleNamespace

    from ..chunks.keys import ChunkKeys, identity_digest
    from ..chunks.suffixed import Suffixed
    from ..integrations.vllm.request_keys import request_seed
    from ..integrations.vllm.retention import rank_names

    if not args.identity:
        raise HurrayError("--tokens needs --identity (the identity string the connector "
                          "logs at start)", field="identity", rule="--identity with --tokens")
    chunk = re.search(r"(?:^|;)chunk_size=([0-9]+)(?:;|$)", args.identity)
    tp = re.search(r"(?:^|;)tp_size=([0-9]+)(?:;|$)", args.identity)
    if chunk is None or int(chunk[1]) <= 0:
        raise HurrayError(f"--identity {args.identity[:120]!r} names no chunk_size=N; it is "
                          "the string the connector logs (`identity model=...;...`)",
                          field="identity", value=args.identity[:120],
                          rule="an identity string with chunk_size")
    try:
        text = sys.stdin.read() if args.tokens == "-" else Path(args.tokens).read_text()
    except OSError as e:
        raise CannotRead(f"{args.tokens}: {e.strerror}") from None
    try:
        tokens = [int(t) for t in (json.loads(text) if text.lstrip().startswith("[")
                                   else text.split())]
    except (ValueError, TypeError) as e:
        raise HurrayError(f"{args.tokens}: not token ids ({e})", field="tokens",
                          rule="a JSON list of integers, or integers apart") from None
    size, ranks = int(chunk[1]), int(tp[1]) if tp else 1
    seed = request_seed(identity_digest(args.identity), SimpleNamespace(
        lora_request=None, cache_salt=args.salt))
    keys = ChunkKeys(seed, size).upto(tokens, len(tokens) // size)
    rank0 = Suffixed(store, ".tp0") if ranks > 1 else store  # as the scheduler looks up
    names = []
    for name in rank0.locate(keys):
        if name is None:
            break  # a hit is a prefix: nothing after the first chunk missing
        names.append(name)
    return [r for n in dict.fromkeys(names) for r in rank_names(n, ranks)]


def cmd_cache_pin(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        names = args.segment or _prefix_names(args, store)
        if not names:
            raise HurrayError("no segment of that prefix is stored (nothing pinned)",
                              field="tokens", rule="a stored prefix")
        done = store.retain(names, pin=not args.unpin, ttl_s=args.ttl)  # set, not merged
    finally:
        store.close()
    missing = [n for n in names if n not in done]
    if args.json:
        print(json.dumps({"url": args.url, "retained": done, "missing": missing,
                          "pin": not args.unpin, "ttl_s": args.ttl}, sort_keys=True))
    elif not args.quiet:
        what = "unpinned" if args.unpin else "pinned"
        life = f", a miss in {args.ttl:g} s" if args.ttl else ""
        print(f"{what} {units.plural(len(done), 'segment')}{life}" + (
            f"; not stored: {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


__all__ = ["add_parsers", "cmd_cache_clear", "cmd_cache_ls", "cmd_cache_pin"]


def number(text: str) -> float:
    """An argparse ``type`` for seconds: ASCII digits only, where float() also reads
    '１２' (and 'inf')."""
    try:
        return units.parse_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: it is a number of seconds above 0, in ASCII digits") from None
