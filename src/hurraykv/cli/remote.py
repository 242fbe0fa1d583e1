"""``serve``, ``push``, ``pull``, ``ls``, ``stat`` and ``rm``: a hurraykv server."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

from .. import units
from ..errors import HurrayError, RemoteError
from .inputs import CannotRead, Input, load_contents
from .outputs import STDOUT, check_output, human, write_output
from .progress import Progress


class NoSuchKey(HurrayError):
    """A key (or alias) the server does not hold, said as such (the server's answer is
    ``UNKNOWN_TENSOR``): exit 1."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no such key {key!r}", field="key", value=key,
                         rule="a key or alias the server holds (`hurraykv ls` lists them)")


def _unknown(e: RemoteError) -> bool:
    from ..net.messages import ErrorCode

    return e.code == ErrorCode.UNKNOWN_TENSOR


@contextlib.contextmanager
def _said_missing(key: str) -> Iterator[None]:
    try:
        yield
    except RemoteError as e:
        if _unknown(e):
            raise NoSuchKey(key) from None
        raise


def _tls(args: argparse.Namespace) -> dict[str, Any]:
    return {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": args.tls_ca}


def loopback(listen: str) -> bool:
    """True for a Unix socket or a loopback host: nobody else can connect."""
    from ..net.server import parse_address

    address = parse_address(listen)
    if isinstance(address, str):
        return True
    host = address[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    """Start-up lines on stdout, each once (the first ends in the address); the server's
    log on stderr; a line of what was held at SIGTERM or Ctrl-C.  A setting the server
    cannot use (``--store``, ``--persist``, ``--tls-*``, ``--listen``) is one line naming
    the option and the value, exit 2, before anything listens."""
    import asyncio
    import logging
    import signal

    from ..net.server import KVServer, ServerConfig

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServerConfig(listen=args.listen, memory_budget=args.memory_budget,
                          persist=args.persist, persist_budget=args.persist_budget,
                          max_pinned_bytes=args.max_pinned_bytes,
                          max_bytes_per_tenant=args.max_bytes_per_tenant,
                          max_message_size=args.max_message_size,
                          read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                          max_connections=args.max_connections,
                          max_connections_per_tenant=args.max_connections_per_tenant,
                          store=args.store,
                          zero_unused=not args.no_zero_unused,
                          metrics_listen=args.metrics_listen, **_tls(args))
    server = KVServer(config)

    def say(text: str) -> None:  # instead of the server's log lines: printed once
        print(f"hurraykv serve: {text}", flush=True)

    server.announce = say
    if not args.tls_cert and not loopback(args.listen):
        print(f"hurraykv serve: warning: serving {args.listen} without TLS: anyone who can "
              "reach it can read, overwrite and delete every key; add --tls-cert, --tls-key "
              "and --tls-ca (mutual TLS scopes keys per client)", file=sys.stderr, flush=True)

    async def run() -> None:
        await server.start()
        budget = ("unlimited" if args.memory_budget is None
                  else units.size(args.memory_budget))
        persist = args.persist or "off"
        if args.persist:
            persist += (" (unlimited)" if args.persist_budget is None
                        else f" (budget {units.size(args.persist_budget)})")
        share = f" ({config.tenant_share()} per tenant)" if args.tls_ca else ""
        say(f"memory budget {budget}; persist {persist}; backing store "
            f"{args.store or 'none'}; TLS "
            f"{'mutual' if args.tls_ca else 'on' if args.tls_cert else 'off'}; at most "
            f"{args.max_connections} connections{share}, messages up to "
            f"{units.size(args.max_message_size)}; holding {server.held()}")
        task = asyncio.current_task()
        assert task is not None
        # SIGTERM (systemd, docker stop, kill) ends it as Ctrl-C does: the server closes
        # its connections and says what it held (asyncio.run cancels on SIGINT itself)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(run())
    return 0


def _client(args: argparse.Namespace) -> Any:
    from ..net.client import KVClient

    args.subject = args.address  # from here on, failures are the server's
    return KVClient(args.address, server_hostname=args.server_hostname, **_tls(args))


def cmd_push(args: argparse.Namespace) -> int:
    args.subject = args.file  # a bad local file is not the server's fault
    contents = load_contents(Input(args.file))
    snap = contents.snapshot
    if snap is None:
        raise CannotRead(f"{args.file} holds no KV snapshot (push takes a .hrry file or a "
                         "stream of one)")
    snap.tensors()  # every member checked before anything is sent
    progress = Progress(f"push {args.key}", args.quiet)
    with _client(args) as client:
        client.check_room(args.key, snap.nbytes)  # STORE_FULL before a byte is sent
        seconds = client.push(args.key, snap, progress=progress)
    progress.close()
    if not args.quiet:
        print(f"pushed {args.key}: {units.size(snap.nbytes)} in {seconds:.3f} s "
              f"({units.rate(snap.nbytes, seconds)})")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from ..io.snapshots import save_snapshot

    args.subject = args.output
    check_output(args.output)  # before the transfer, not after it
    progress = Progress(f"pull {args.key}", args.quiet)
    t0 = time.perf_counter()
    with _client(args) as client, _said_missing(args.key):
        snap = client.pull(args.key, progress=progress)
    seconds = time.perf_counter() - t0
    progress.close()
    args.subject = args.output
    write_output(args.output, lambda path: save_snapshot(snap, path,
                                                         fsync=args.output != STDOUT))
    if not args.quiet:
        shown = "<stdout>" if args.output == STDOUT else args.output
        print(f"pulled {args.key}: {units.size(snap.nbytes)} in {seconds:.3f} s "
              f"({units.rate(snap.nbytes, seconds)}) -> {shown}", file=human(args.output))
    return 0


GLOB = re.compile(r"\\.|[*?]|\[(?:\\.|[^\]\\])+\]")  # \x, *, ?, a closed [...]
WILDCARDS = {"*": ".*", "?": "."}


def glob(pattern: str) -> tuple[str, re.Pattern[str] | None]:
    """``ls PREFIX``: the literal prefix to ask the server for, and the regular
    expression the whole key must match where ``pattern`` is a Redis-style glob (``*``,
    ``?``, ``[abc]``, ``[^a]``, ``[a-z]``; ``\\x`` is ``x`` itself; a ``[`` never
    closed is itself); None for a plain prefix (escapes undone)."""
    regex, prefix, wild, at = [], [], False, 0
    for m in GLOB.finditer(pattern):
        escaped = m[0].startswith("\\")
        literal = pattern[at:m.start()] + (m[0][1] if escaped else "")
        at = m.end()
        regex.append(re.escape(literal))
        if not wild:  # the server filters by what comes before the first wildcard
            prefix.append(literal)
        if not escaped:
            wild = True
            regex.append(WILDCARDS.get(m[0]) or _char_class(m[0][1:-1]))
    tail = pattern[at:]
    if not wild:
        return "".join(prefix) + tail, None
    return "".join(prefix), re.compile("".join(regex) + re.escape(tail), re.DOTALL)


def _char_class(body: str) -> str:
    negate = body.startswith("^")
    body = body[1:] if negate else body
    items = re.findall(r"\\.|.", body, re.DOTALL)
    chars = [c[-1] for c in items]
    out, i = [], 0
    while i < len(chars):
        if i + 2 < len(chars) and items[i + 1] == "-":
            lo, hi = sorted((chars[i], chars[i + 2]))  # Redis takes z-a as a-z
            out.append(f"{re.escape(lo)}-{re.escape(hi)}")
            i += 3
        else:
            out.append(re.escape(chars[i]))
            i += 1
    return f"[{'^' if negate else ''}{''.join(out)}]" if out else ("(?s:.)" if negate
                                                                    else "(?!)")


def _matching(pattern: str, fetch: Any) -> list[Any]:
    """What ``fetch(prefix)`` lists (pairs, the name first) that ``pattern`` names."""
    prefix, whole = glob(pattern)
    found = fetch(prefix)
    return found if whole is None else [n for n in found if whole.fullmatch(n[0])]


def cmd_ls(args: argparse.Namespace) -> int:
    if args.aliases:
        with _client(args) as client:
            aliases = sorted(_matching(args.prefix, client.aliases))
        if args.json:
            print(json.dumps({"address": args.address, "prefix": args.prefix,
                              "count": len(aliases), "aliases": [
                                  {"alias": a, "target": t} for a, t in aliases]},
                             sort_keys=True))
            return 0
        width = max((len(a) for a, _ in aliases), default=5)
        for alias, target in aliases:
            print(f"{alias:<{width}}  -> {target}")
        print(units.plural(len(aliases), "alias") + (" (`hurraykv rm` removes one)"
                                                      if aliases else ""))
        return 0
    with _client(args) as client:
        keys = sorted(_matching(args.prefix, client.list_keys))
    total = sum(n for _, n in keys)
    if args.json:
        print(json.dumps({"address": args.address, "prefix": args.prefix,
                          "count": len(keys), "bytes": total,
                          "keys": [{"key": k, "bytes": n} for k, n in keys]},
                         sort_keys=True))
        return 0
    width = max((len(k) for k, _ in keys), default=3)
    for key, nbytes in keys:
        print(f"{key:<{width}}  {units.size(nbytes):>12}")
    print(f"{units.plural(len(keys), 'key')}, {units.size(total)}")
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    with _client(args) as client:
        s = client.stat()
    if args.json:
        print(json.dumps(s, sort_keys=True))
        return 0
    budget = s.get("memory_budget")
    persist = s.get("persist")
    rows = [
        ("server", f"hurraykv {s.get('version')} at {s.get('address')}, up "
                   f"{s.get('uptime_s', 0):.0f} s"),
        ("objects", f"{units.count(s.get('objects_in_memory', 0))} in memory, "
                    f"{units.count(s.get('persisted_objects', 0))} persisted"),
        ("memory", f"{units.size(s.get('memory_bytes', 0))} held, "
                   f"{units.size(s.get('reserved_bytes', 0))} reserved by pushes in flight"
                   + (f", {units.size(s['idle_receive_bytes'])} idle receive buffers"
                      if "idle_receive_bytes" in s else "")),
        ("budget", ("unlimited" if budget is None else units.size(budget))
         + (" (shared by every tenant)" if "tenant" in s else "")),
        ("connections", f"{s.get('connections')} of at most {s.get('max_connections')}"),
        ("aliases", f"{units.count(s.get('aliases', 0))}, "
                    f"{units.size(s.get('alias_bytes', 0))} held"),
        ("persist", "on" if persist is True else str(persist or "off")),
        ("backing store", "yes" if s.get("backing_store") else "none"),
    ]
    if persist:
        cap = s.get("persist_budget")
        rows.append(("persisted", f"{units.size(s.get('persisted_bytes', 0))} of "
                     f"{'unlimited' if cap is None else units.size(cap)} (--persist-budget)"))
    if "memory_evictions" in s:  # server-wide counts: not shown to a tenant
        rows.insert(4, ("evictions", f"{units.count(s['memory_evictions'])} from memory, "
                                     f"{units.count(s.get('disk_evictions', 0))} from disk"))
    if "pushes" in s:
        errors = sum(s.get("errors", {}).values())
        rows.append(("traffic", f"{units.plural(s['pushes'], 'push')}, "
                                f"{units.plural(s.get('pulls', 0), 'pull')}, "
                                f"{units.size(s.get('bytes_received', 0))} received, "
                                f"{units.size(s.get('bytes_sent', 0))} sent, "
                                f"{units.plural(errors, 'error')}"))
    if "tenant" in s:  # a server under mutual TLS counts this client's own
        rows.insert(1, ("tenant", f"{s['tenant']} (the counts below are this tenant's)"))
    for name, value in rows:
        print(f"{name:<13}: {value}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Every key that exists is removed, whatever its place among missing ones (as
    ``DEL`` does); each missing one is named on stderr, and makes the exit 1."""
    missing = 0
    with _client(args) as client:
        for key in args.keys:
            try:
                client.delete(key)
            except RemoteError as e:
                if not _unknown(e):
                    raise
                missing += 1
                print(f"hurraykv: {args.address}: {NoSuchKey(key)}", file=sys.stderr)
                continue
            if not args.quiet:
                print(f"removed {key}")
    return 1 if missing else 0
