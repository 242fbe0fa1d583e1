"""The ``hurraykv`` command line.

    hurraykv inspect [--json] [--seqs] [--map OUT.svg] PATH   a descriptor, stream or .hrry
    hurraykv validate [--permissive] PATH
    hurraykv compact IN OUT              keep only referenced pages (.hrry or stream in)
    hurraykv serve [--listen 127.0.0.1:7878] [--memory-budget 8G] [--persist DIR]
                   [--persist-budget 64G] [--metrics-listen HOST:PORT] ...
    hurraykv push ADDRESS KEY FILE  /  hurraykv pull ADDRESS KEY OUT.hrry
    hurraykv ls [--aliases] ADDRESS [PREFIX]  /  stat ADDRESS  /  rm ADDRESS KEY...
    hurraykv store fsck URL              repair a Redis page store after a crash
    hurraykv cache ls [--segments] URL   a connector's store: per cache identity
    hurraykv cache clear URL (--identity ID | --all)
    hurraykv cache pin URL (--segment NAME | --tokens FILE --identity S) [--ttl S] [--unpin]

Exit codes: 0 success; 1 the data was rejected (by hurraykv or by the server; the reason
on stderr); 2 usage, or a file, directory or server that cannot be read, written or
reached.  Progress bars go to stderr for work over about a second, unless --quiet or
stderr is not a terminal.  Sizes are binary (KiB, MiB, GiB), rates GiB/s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .. import __version__, units
from ..errors import HurrayError, MissingDependencyError, TransportError
from .cache import add_parsers as add_cache_parsers
from .inputs import CannotRead
from .local import cmd_compact, cmd_inspect, cmd_validate
from .remote import cmd_ls, cmd_pull, cmd_push, cmd_rm, cmd_serve, cmd_stat
from .store import cmd_store_fsck

USAGE, INVALID = 2, 1


def _greater_than_zero(parse: Callable[[str], Any], what: str, rule: str
                       ) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse`` the text, which must name ``what``, and be > 0."""
    def check(text: str) -> Any:
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
        return v
    return check


_size = _greater_than_zero(units.parse_size, "a size like 8G, 512M or 1048576",
                           "a size must be > 0")
_seconds = _greater_than_zero(float, "a number of seconds", "seconds must be > 0")
_positive = _greater_than_zero(int, "a whole number", "must be > 0")


def _metrics_address(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` for the HTTP metrics endpoint."""
    from ..net.metrics import parse_metrics_address

    try:
        parse_metrics_address(text)
    except HurrayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _client_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("address", help="the server: HOST:PORT, HOST (port 7878), "
                    "hurray://HOST:PORT, or a Unix socket path")
    sp.add_argument("--tls-ca", help="PEM CA bundle that verifies the server's certificate "
                    "(enables TLS)")
    sp.add_argument("--tls-cert", help="PEM client certificate, for a server that requires "
                    "one (mutual TLS: its identity is your tenant, which scopes your keys)")
    sp.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sp.add_argument("--server-hostname", help="the name the server's certificate must carry "
                    "(default: the host of ADDRESS)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hurraykv", description=__doc__.splitlines()[0],
                                epilog="exit codes: 0 success, 1 data rejected, 2 usage or "
                                "cannot read/write/reach")
    p.add_argument("--version", action="version", version=(
        f"hurraykv {__version__} (Hurray descriptor 1.0, .hrry container 1.0, "
        "interchange protocol 1)"))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    i = sub.add_parser("inspect", help="what a descriptor, stream or .hrry file holds: "
                       "tokens, pages, bytes, members")
    i.add_argument("--json", action="store_true", help="every number as one JSON object")
    i.add_argument("--seqs", action="store_true",
                   help="list every sequence: tokens, pages, block table")
    i.add_argument("--map", metavar="OUT.svg",
                   help="also draw the block table of the first member as an SVG picture")
    i.add_argument("--permissive", action="store_true",
                   help="decode a descriptor as a permissive reader may")
    i.add_argument("path", help="a file, or - for standard input")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("validate", help="exit 0 when valid, 1 when rejected (the reason on "
                       "stderr)")
    v.add_argument("--permissive", action="store_true",
                   help="skip what the spec lets a permissive reader skip (descriptors)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.add_argument("path", help="a file, or - for standard input")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compact", help="rewrite a snapshot keeping only referenced pages")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("input", help="a .hrry file or a stream holding a snapshot")
    c.add_argument("output", help="the .hrry file to write (atomically)")
    c.set_defaults(func=cmd_compact)

    sv = sub.add_parser("serve", help="run a KV cache server")
    sv.add_argument("--listen", default="127.0.0.1:7878",
                    help="HOST:PORT or a Unix socket path (default: loopback 127.0.0.1:7878; "
                    "a port of 0 picks a free one)")
    sv.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                    help="most bytes of snapshot data held in memory, pushes in flight "
                    "included, e.g. 8G or 512M (binary units); beyond it the least "
                    "recently used objects leave memory (served again from --persist "
                    "files) and a push that still cannot fit is refused with STORE_FULL; "
                    "default: unlimited")
    sv.add_argument("--persist", metavar="DIR",
                    help="keep each committed snapshot as a .hrry file in DIR (kept across "
                    "restarts); default: memory only")
    sv.add_argument("--max-bytes-per-tenant", type=_size, default=None, metavar="SIZE",
                    help="with --tls-ca: most bytes of one client identity's (tenant's) "
                    "objects in memory; past it that tenant's own least recently used "
                    "objects leave memory, never another's, and a push that still cannot "
                    "fit is refused with STORE_FULL; default: no quota")
    sv.add_argument("--max-pinned-bytes", type=_size, default=None, metavar="SIZE",
                    help="most bytes of objects pinned (RETAIN: never evicted to make "
                    "room); a pin past it is refused with STORE_FULL; default: a quarter "
                    "of the smaller budget (unlimited without one)")
    sv.add_argument("--persist-budget", type=_size, default=None, metavar="SIZE",
                    help="most bytes of .hrry files kept in --persist DIR, e.g. 64G; beyond "
                    "it the least recently pushed or pulled files are deleted, and a "
                    "snapshot whose file alone is larger is refused with STORE_FULL; "
                    "default: unlimited")
    sv.add_argument("--metrics-listen", type=_metrics_address, metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics and a health "
                    "check at /healthz (needs the [metrics] extra: prometheus_client); "
                    "default: off")
    sv.add_argument("--store", metavar="URL", help="backing tier: redis://HOST:PORT or "
                    "redis+cluster://HOST:PORT (pages stored once, shared by servers)")
    sv.add_argument("--max-message-size", type=_size, default=16 << 20, metavar="SIZE",
                    help="largest message payload accepted (data frames included); "
                    "default 16M")
    sv.add_argument("--read-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="a message that has started must finish arriving within this; "
                    "default 30")
    sv.add_argument("--idle-timeout", type=_seconds, default=600.0, metavar="SECONDS",
                    help="a connection silent this long is closed; default 600")
    sv.add_argument("--max-connections", type=_positive, default=256, metavar="N",
                    help="connections beyond this are answered SERVER_BUSY; default 256")
    sv.add_argument("--no-zero-unused", action="store_true",
                    help="do not zero unused page slots before data leaves the process")
    sv.add_argument("--log-level", default="info",
                    choices=["debug", "info", "warning", "error"], help="default info")
    sv.add_argument("--tls-cert", help="PEM server certificate (enables TLS)")
    sv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sv.add_argument("--tls-ca", help="PEM CA bundle; the server then requires client "
                    "certificates, whose identity scopes each client's keys (mutual TLS)")
    sv.set_defaults(func=cmd_serve)
    for name, helptext in (("push", "push a snapshot (.hrry file or stream) to a server"),
                           ("pull", "pull a snapshot from a server into a .hrry file")):
        sp = sub.add_parser(name, help=helptext)
        _client_options(sp)
        sp.add_argument("key")
        if name == "push":
            sp.add_argument("file", help="a .hrry file or a stream holding a snapshot")
        else:
            sp.add_argument("output", help="the .hrry file to write (atomically)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(func=cmd_push if name == "push" else cmd_pull)
    ls = sub.add_parser("ls", help="the keys a server holds, with their sizes")
    _client_options(ls)
    ls.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    ls.add_argument("--aliases", action="store_true", help="list aliases (LINK) and the "
                    "keys they name instead of stored keys")
    ls.set_defaults(func=cmd_ls)
    st = sub.add_parser("stat", help="a server's objects, bytes, budget and connections")
    _client_options(st)
    st.set_defaults(func=cmd_stat)
    rm = sub.add_parser("rm", help="delete keys (and the aliases naming them) or aliases "
                        "from a server")
    _client_options(rm)
    rm.add_argument("keys", nargs="+", metavar="KEY")
    rm.set_defaults(func=cmd_rm)
    store = sub.add_parser("store", help="maintain a Redis/Valkey page store")
    ssub = store.add_subparsers(dest="store_command", required=True, metavar="COMMAND")
    fs = ssub.add_parser("fsck", help="after a client or server crash: recompute page "
                         "references from the manifests, free orphaned pages, fix the "
                         "statistics, and say what changed (exit 1 if a snapshot that "
                         "lost pages could not be removed, 2 if the store cannot be "
                         "reached)")
    fs.add_argument("url", help="redis://HOST:PORT or redis+cluster://HOST:PORT")
    fs.add_argument("--grace", type=_seconds, default=3600.0, metavar="SECONDS",
                    help="references drawn this recently may belong to a put still "
                    "running and are kept; default 3600")
    fs.add_argument("--json", action="store_true", help="the report as one JSON object")
    fs.set_defaults(func=cmd_store_fsck)
    add_cache_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "persist_budget", None) is not None and not args.persist:
        parser.error("--persist-budget bounds the --persist directory: give --persist DIR")
    if getattr(args, "max_bytes_per_tenant", None) is not None and not args.tls_ca:
        parser.error("--max-bytes-per-tenant bounds each client identity of mutual TLS: "
                     "give --tls-ca (and --tls-cert, --tls-key)")
    args.subject = (getattr(args, "path", None) or getattr(args, "input", None)
                    or getattr(args, "address", None) or getattr(args, "url", ""))
    try:
        return args.func(args)
    except CannotRead as e:
        print(f"hurraykv: {e}", file=sys.stderr)
        return USAGE
    except (TransportError, MissingDependencyError) as e:
        print(f"hurraykv: {e}", file=sys.stderr)
        return USAGE
    except OSError as e:  # a file the user named
        print(f"hurraykv: {args.subject}: {e.strerror or e}", file=sys.stderr)
        return USAGE
    except HurrayError as e:
        print(f"hurraykv: {args.subject}: {type(e).__name__}: {e}", file=sys.stderr)
        return INVALID


__all__ = ["build_parser", "main"]
