"""The ``hurraykv`` command line.

    hurraykv inspect [--json] [--seqs] [--map OUT.svg] PATH   a descriptor, stream or .hrry
    hurraykv validate [--json] [-q] [--permissive] PATH
    hurraykv compact [-q] IN OUT         keep only referenced pages (.hrry or stream in)
    hurraykv serve [--listen 127.0.0.1:7878] [--memory-budget 8G] [--persist DIR]
                   [--persist-budget 64G] [--metrics-listen HOST:PORT] ...
    hurraykv push [-q] ADDRESS KEY FILE  /  hurraykv pull [-q] ADDRESS KEY OUT.hrry
    hurraykv ls [--json] [--aliases] ADDRESS [PREFIX]  /  stat [--json] ADDRESS
    hurraykv rm [-q] ADDRESS KEY...      every KEY that exists; exit 1 if one is missing
    hurraykv store fsck URL              repair a Redis page store after a crash
    hurraykv cache ls [--segments] URL   a connector's store: per cache identity
    hurraykv cache clear URL (--identity ID | --all)
    hurraykv cache pin URL (--segment NAME | --tokens FILE --identity S) [--ttl S] [--unpin]

``python -m hurraykv`` is the same command.  A KEY is 1 to 4096 UTF-8 bytes without
NUL (an empty one is a usage error); a PREFIX with ``*``, ``?`` or ``[...]`` is a
Redis-style glob the whole key must match (``\\*`` a literal ``*``), any other a literal
prefix.  A key the server does not hold is said ``no such key 'KEY'``.

A path of ``-`` is standard input for what is read (inspect, validate) and standard
output for the .hrry file ``compact`` and ``pull`` write; their summary line then goes to
stderr, so standard output holds only the file.

Exit codes: 0 success; 1 the data was rejected (by hurraykv or by the server; the reason
on stderr as ``hurraykv: SUBJECT: ERRORTYPE: message``, the file, address or URL first,
or for a key the server does not hold ``hurraykv: ADDRESS: no such key 'KEY'``; with
``--json``, ``inspect`` and ``validate`` also print ``{path, valid: false, error: {type,
message, field}}`` on stdout); 2 usage (an option, address or URL that cannot be
used, named with its value and the rule), or a file, directory or server that cannot be
read, written or reached; 141 (128 + SIGPIPE, as for a program the signal ends) when
whoever reads standard output closed it early (``| head``): nothing more is printed.
Progress bars go to stderr for work over about a second, unless -q/--quiet (which also
drops the summary line) or stderr is not a terminal. Sizes are binary (KiB, MiB, GiB),
rates too (bytes/s, KiB/s, MiB/s, GiB/s: the unit that fits).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol

from .. import __version__, units
from ..errors import (
    ConfigError,
    HurrayError,
    MissingDependencyError,
    TransportError,
    did_you_mean,
)
from .cache import add_parsers as add_cache_parsers
from .inputs import CannotRead
from .local import cmd_compact, cmd_inspect, cmd_validate
from .remote import NoSuchKey, cmd_ls, cmd_pull, cmd_push, cmd_rm, cmd_serve, cmd_stat
from .store import cmd_store_fsck

USAGE, INVALID = 2, 1
CLOSED_PIPE = 128 + 13  # SIGPIPE: the exit status of a program the signal ends


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped command, choice or option, and a usage
    error in one line (the usage block is what ``--help`` is for)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        bad = re.search(r"invalid choice: '?([^' ]*)'?", message)
        if bad is not None:
            known = [str(c) for a in self._actions if a.choices is not None
                     for c in a.choices]
            message += did_you_mean(bad.group(1), known)
        self.exit(USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # the command's own parser says it, with its options to match against
            command = getattr(parsed, "_parser", self)
            options = [o for a in command._actions for o in a.option_strings]
            unknown = next((x for x in extra if x.startswith("-")), extra[0])
            command.error(f"unrecognized arguments: {' '.join(extra)}"
                          + did_you_mean(unknown.split("=")[0], options))
        return parsed


class _Version(argparse.Action):
    """``--version``: the line as written (argparse's own wraps it to the terminal's
    width, and to 80 columns through a pipe)."""

    def __init__(self, option_strings: list[str], version: str, dest: str = "version",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and the format versions it reads, and exit")
        self.version = version

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(self.version)
        parser.exit()


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
# ASCII digits only: Python's float() and int() also read '１２' and '٢' as numbers
_seconds = _greater_than_zero(units.parse_float, "a number of seconds", "seconds must be > 0")
_positive = _greater_than_zero(units.parse_int, "a whole number", "must be > 0")


def _address(text: str) -> str:
    """An argparse ``type``: a server address (``HOST:PORT``, a socket path, ...), checked
    as the server and the client parse it (a usage error otherwise); kept as given."""
    from ..net.server import parse_address

    try:
        parse_address(text)
    except HurrayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _key(text: str) -> str:
    """An argparse ``type``: a key as the server takes it (1 to 4096 UTF-8 bytes, no NUL),
    so that an empty one is a usage error here rather than a rejection by the server."""
    from ..net.tenants import check_key

    try:
        return check_key(text)
    except HurrayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except UnicodeEncodeError:  # bytes of no encoding, kept by the filesystem decoding
        raise argparse.ArgumentTypeError(f"key {text!r} is not UTF-8 text: a key is 1 to "
                                         "4096 UTF-8 bytes without NUL") from None


KEY_RULE = "1 to 4096 UTF-8 bytes, no NUL; under mutual TLS, your tenant's own"


def _metrics_address(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` for the HTTP metrics endpoint."""
    from ..net.metrics import parse_metrics_address

    try:
        parse_metrics_address(text)
    except HurrayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _quiet(sp: argparse.ArgumentParser, what: str = "progress bar") -> None:
    sp.add_argument("-q", "--quiet", action="store_true", help=f"no {what} and no summary "
                    "line (errors still go to stderr; the exit code says how it went)")


def _client_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("address", type=_address, metavar="ADDRESS", help="the server: HOST:PORT, HOST "
                    "(port 7878), hurray://HOST:PORT, or a Unix socket path (the address "
                    "`hurraykv serve` prints as 'listening on', not its metrics port)")
    sp.add_argument("--tls-ca", help="PEM CA bundle that verifies the server's certificate "
                    "(enables TLS)")
    sp.add_argument("--tls-cert", help="PEM client certificate, for a server that requires "
                    "one (mutual TLS: its identity is your tenant, which scopes your keys)")
    sp.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sp.add_argument("--server-hostname", help="the name the server's certificate must carry "
                    "(default: the host of ADDRESS)")


class _Commands(Protocol):
    """What ``add_subparsers`` returns (its class is argparse's own, private): where a
    command's parser is added."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hurraykv", description="Inspect, validate, serve and move KV caches "
                "in the Hurray block-paged format.",
                epilog="exit codes: 0 success, 1 data rejected, 2 usage or cannot "
                "read/write/reach, 141 standard output closed early (| head)")
    p.add_argument("--version", action=_Version, version=(
        f"hurraykv {__version__} (Hurray descriptor 1.0, .hrry container 1.0, "
        "interchange protocol 1)"))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_file_commands(sub)
    _add_serve_command(sub)
    _add_transfer_commands(sub)
    _add_server_admin_commands(sub)
    _add_store_commands(sub)
    add_cache_parsers(sub)
    _name_own_parsers(p)
    return p


def _add_file_commands(sub: _Commands) -> None:
    """inspect, validate, compact: files, streams and descriptors (``local.py``)."""
    i = sub.add_parser("inspect", help="what a descriptor, stream or .hrry file holds: "
                       "tokens, pages, bytes, members")
    i.add_argument("--json", action="store_true", help="every number as one JSON object")
    i.add_argument("--seqs", action="store_true",
                   help="list every sequence: tokens, pages, block table")
    i.add_argument("--map", metavar="OUT.svg",
                   help="also draw the block table of the first member as an SVG picture")
    i.add_argument("--permissive", action="store_true",
                   help="decode a descriptor as a permissive reader may")
    i.add_argument("path", metavar="PATH", help="a file, or - for standard input")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("validate", help="exit 0 when valid, 1 when rejected (the reason on "
                       "stderr)")
    v.add_argument("--permissive", action="store_true",
                   help="skip what the spec lets a permissive reader skip (descriptors)")
    v.add_argument("--json", action="store_true", help="the verdict as one JSON object on "
                   "stdout, also when rejected: path, valid, kind, snapshot, checksums "
                   "(verified, absent or null), summary; or error {type, message, field}")
    _quiet(v)
    v.add_argument("path", metavar="PATH", help="a file, or - for standard input")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compact", help="rewrite a snapshot keeping only referenced pages")
    _quiet(c)
    c.add_argument("input", metavar="IN", help="a .hrry file or a stream holding a snapshot")
    c.add_argument("output", metavar="OUT", help="the .hrry file to write (atomically), or "
                   "- for standard output (the summary then goes to stderr)")
    c.set_defaults(func=cmd_compact)


def _add_serve_command(sub: _Commands) -> None:
    sv = sub.add_parser("serve", help="run a KV cache server", description="Run a KV "
                        "cache server.  Start-up lines go to stdout, once each (the first "
                        "ends in the address clients use); the log goes to stderr; SIGTERM "
                        "or Ctrl-C closes every connection and prints what was held.  A "
                        "setting that cannot be used (--listen, --store, --persist, "
                        "--tls-*) is one line naming the option and the value, exit 2.")
    sv.add_argument("--listen", default="127.0.0.1:7878", type=_address,
                    help="HOST:PORT or a Unix socket path (default: loopback 127.0.0.1:7878; "
                    "a port of 0 picks a free one)")
    _serve_budgets(sv)
    sv.add_argument("--metrics-listen", type=_metrics_address, metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics and a health "
                    "check at /healthz (needs the [metrics] extra: prometheus_client); "
                    "default: off")
    sv.add_argument("--store", metavar="URL", help="backing tier: redis://HOST:PORT or "
                    "redis+cluster://HOST:PORT (pages stored once, shared by servers)")
    _serve_connection_limits(sv)
    sv.add_argument("--no-zero-unused", action="store_true",
                    help="do not zero unused page slots before data leaves the process")
    sv.add_argument("--log-level", default="info",
                    choices=["debug", "info", "warning", "error"], help="default info")
    sv.add_argument("--tls-cert", help="PEM server certificate (enables TLS)")
    sv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sv.add_argument("--tls-ca", help="PEM CA bundle; the server then requires client "
                    "certificates, whose identity scopes each client's keys (mutual TLS)")
    sv.set_defaults(func=cmd_serve)


def _serve_budgets(sv: argparse.ArgumentParser) -> None:
    """What the server holds: memory, its --persist directory, per tenant, pinned."""
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
                    help="with --tls-ca: most bytes one client identity (tenant) makes the "
                    "server hold in memory (objects, pushes in flight, aliases); past it, and "
                    "under --memory-budget, only that tenant's own least recently used "
                    "objects leave memory, never another's, and a push that still cannot "
                    "fit is refused with STORE_FULL; default: no quota")
    sv.add_argument("--max-pinned-bytes", type=_size, default=None, metavar="SIZE",
                    help="most bytes of objects pinned (RETAIN: never evicted to make "
                    "room); a pin past it, or a push of a pinned key whose new size would "
                    "pass it, is refused with STORE_FULL; default: a quarter of the "
                    "smaller budget (unlimited without one)")
    sv.add_argument("--persist-budget", type=_size, default=None, metavar="SIZE",
                    help="most bytes of .hrry files kept in --persist DIR, e.g. 64G; beyond "
                    "it the least recently pushed or pulled files are deleted, and a "
                    "snapshot whose file alone is larger is refused with STORE_FULL; "
                    "default: unlimited")


def _serve_connection_limits(sv: argparse.ArgumentParser) -> None:
    """What one connection may send, how long it may take, and how many there are."""
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
    sv.add_argument("--max-connections-per-tenant", type=_positive, default=None,
                    metavar="N", help="with --tls-ca: connections one client identity "
                    "(tenant) may hold at once, at most --max-connections; its next one is "
                    "answered SERVER_BUSY naming this limit, and other tenants still "
                    "connect; default a quarter of --max-connections (at least 1)")


def _add_transfer_commands(sub: _Commands) -> None:
    """push, pull: a snapshot to or from a server."""
    for name, helptext in (("push", "push a snapshot (.hrry file or stream) to a server"),
                           ("pull", "pull a snapshot from a server into a .hrry file")):
        sp = sub.add_parser(name, help=helptext)
        _client_options(sp)
        sp.add_argument("key", type=_key, metavar="KEY", help=(
            "the name to store the snapshot under" if name == "push" else
            "the key (or alias) to fetch") + f" ({KEY_RULE})")
        if name == "push":
            sp.add_argument("file", metavar="FILE", help="a .hrry file or a stream holding a "
                            "snapshot (one larger than a budget the server's stat shows is "
                            "refused before a byte is sent)")
        else:
            sp.add_argument("output", metavar="OUT.hrry", help="the .hrry file to write "
                            "(atomically), or - for standard output (the summary then goes "
                            "to stderr)")
        _quiet(sp)
        sp.set_defaults(func=cmd_push if name == "push" else cmd_pull)


def _add_server_admin_commands(sub: _Commands) -> None:
    """ls, stat, rm: what a server holds, and its removal."""
    ls = sub.add_parser("ls", help="the keys a server holds, with their sizes",
                        description="The keys a server holds (in memory or persisted), "
                        "each with its size: its data bytes, the tensors' buffers as "
                        "pushed (not the size of its .hrry file on disk), the same before "
                        "and after a restart of the server.  A server with --store lists "
                        "what it holds itself: keys only in the Redis store (pushed before "
                        "its restart, or by another server) are pulled but not listed.")
    _client_options(ls)
    ls.add_argument("prefix", nargs="?", default="", metavar="PREFIX", help="only keys "
                    "starting with this; with *, ? or [...] a Redis-style glob the whole "
                    "key must match (k* = keys starting with k; \\* is a literal *)")
    ls.add_argument("--aliases", action="store_true", help="list aliases (LINK) and the "
                    "keys they name instead of stored keys")
    ls.add_argument("--json", action="store_true", help="one JSON object: address, prefix, "
                    "count, bytes and keys [{key, bytes}] (with --aliases: aliases "
                    "[{alias, target}])")
    ls.set_defaults(func=cmd_ls)
    st = sub.add_parser("stat", help="a server's objects, bytes, budget and connections")
    _client_options(st)
    st.add_argument("--json", action="store_true", help="the server's counters as one JSON "
                    "object, as it sends them (bytes as integers, budgets null when "
                    "unlimited)")
    st.set_defaults(func=cmd_stat)
    rm = sub.add_parser("rm", help="delete keys (and the aliases naming them) or aliases "
                        "from a server")
    _client_options(rm)
    _quiet(rm, "line per key removed")
    rm.add_argument("keys", nargs="+", metavar="KEY", type=_key, help="keys (each "
                    "removed with the aliases naming it) or aliases to remove, each "
                    f"{KEY_RULE}; every one that exists is removed, each missing one "
                    "named on stderr (exit 1)")
    rm.set_defaults(func=cmd_rm)


def _add_store_commands(sub: _Commands) -> None:
    """store fsck: a Redis/Valkey page store (``store.py``)."""
    store = sub.add_parser("store", help="maintain a Redis/Valkey page store")
    ssub = store.add_subparsers(dest="store_command", required=True, metavar="COMMAND")
    fs = ssub.add_parser("fsck", help="after a client or server crash: recompute page "
                         "references from the manifests, verify every page against its "
                         "key (a damaged one is deleted with the snapshots naming it), "
                         "free orphaned pages, fix the statistics, and say what changed "
                         "(exit 1 if a snapshot that lost pages could not be removed, 2 "
                         "if the store cannot be reached)")
    fs.add_argument("url", help="redis://HOST:PORT or redis+cluster://HOST:PORT")
    fs.add_argument("--grace", type=_seconds, default=3600.0, metavar="SECONDS",
                    help="references drawn this recently may belong to a put still "
                    "running and are kept; default 3600")
    fs.add_argument("--json", action="store_true", help="the report as one JSON object")
    fs.set_defaults(func=cmd_store_fsck)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers of ``parser``'s commands: the choices of its subparsers action, the one
    action whose choices map names to parsers."""
    for action in parser._actions:
        if isinstance(action.choices, dict):
            yield from (c for c in action.choices.values()
                        if isinstance(c, argparse.ArgumentParser))


def _name_own_parsers(parser: argparse.ArgumentParser) -> None:
    """Each command's parser recorded in what it parses (``_parser``): an unknown option
    is then said by the command it was given to, against that command's options."""
    for sp in _subcommands(parser):
        sp.set_defaults(_parser=sp)
        _name_own_parsers(sp)


def _numeric_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings, in ``parser`` and its subcommands, that take a number."""
    found: set[str] = set()
    for action in parser._actions:
        if action.option_strings and (action.type in (_size, _seconds, _positive, int, float)):
            found.update(action.option_strings)
    for sub in _subcommands(parser):
        found |= _numeric_options(sub)
    return found


def _negatives_attached(argv: list[str], options: set[str]) -> list[str]:
    """``--memory-budget -5G`` as ``--memory-budget=-5G``: argparse takes ``-5G`` for an
    option and says only "expected one argument"; attached, the value reaches its type,
    which says why it cannot be (a size must be > 0)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg in options and i + 1 < len(argv) and re.match(r"-\.?[0-9]", argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _stdout_closed() -> int:
    """Whoever reads standard output has closed it: say nothing more, exit as SIGPIPE
    would (Python's own flush at exit would otherwise print a traceback)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # not a real descriptor (a test's capture): nothing flushes it at exit
    return CLOSED_PIPE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_negatives_attached(argv, _numeric_options(parser)))
    if getattr(args, "persist_budget", None) is not None and not args.persist:
        parser.error("--persist-budget bounds the --persist directory: give --persist DIR")
    if getattr(args, "max_bytes_per_tenant", None) is not None and not args.tls_ca:
        parser.error("--max-bytes-per-tenant bounds each client identity of mutual TLS: "
                     "give --tls-ca (and --tls-cert, --tls-key)")
    args.subject = (getattr(args, "path", None) or getattr(args, "input", None)
                    or getattr(args, "address", None) or getattr(args, "url", ""))
    if args.subject == "-":  # as the messages name standard input
        args.subject = "<stdin>"

    def say(text: str, subject: str | None = None) -> None:
        subject = args.subject if subject is None else subject
        print(f"hurraykv: {subject}: {text}" if subject else f"hurraykv: {text}",
              file=sys.stderr)

    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone shows here, not at exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (CannotRead, TransportError, MissingDependencyError, ConfigError) as e:
        say(str(e), "")  # each names what it could not read, reach or use
        return USAGE
    except OSError as e:  # a file the user named
        say(e.strerror or str(e), str(e.filename) if e.filename else None)
        return USAGE
    except NoSuchKey as e:  # the server's answer, in the user's words
        say(str(e))
        return INVALID
    except HurrayError as e:
        say(error_text(e, args.subject))
        return INVALID


def error_text(e: HurrayError, subject: str | None) -> str:
    """``TYPE: message`` for the line ``hurraykv: SUBJECT: TYPE: message``: the subject
    is said first and once, also where the message itself starts by naming it."""
    text = str(e)
    if subject and text.startswith(f"{subject}: "):
        text = text[len(subject) + 2:]
    return f"{type(e).__name__}: {text}"


__all__ = ["build_parser", "error_text", "main"]
