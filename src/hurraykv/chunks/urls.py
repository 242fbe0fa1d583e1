"""Store URLs: why a URL names no store (its scheme, form, host, options and every part
its store would not read), and ``open_store``, which opens the store a URL names."""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import re
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import ParseResult, parse_qsl, unquote, urlparse

from ..errors import ConfigError, HurrayError, TransportError
from .registry import (
    ChunkStore,
    describe,
    is_builtin,
    options,
    schemes,
    store_class,
    store_classes,
    url_forms,
)
from .suffixed import Suffixed

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# how a character that would start a URL part is written inside a path
ESCAPED = {"params": ("';'", "%3B"), "query": ("'?'", "%3F"), "fragment": ("'#'", "%23")}


def url_problem(url: str, options: Sequence[str] = ()) -> str:
    """Why ``url`` (with open_store keywords ``options``) names no store ("" if it does):
    its scheme and form, and every part present read by its store."""
    control = CONTROL.search(url)
    if control:  # urlparse drops tabs and newlines anywhere, silently
        return (f"character {control.start()} is {control.group()!r}; a URL holds no "
                "control characters (percent-encode them)")
    try:
        parsed = urlparse(url)
    except ValueError as e:  # "hurray://[::1": an unclosed IPv6 address
        return f"it does not parse as a URL: {e}"
    cls = store_class(parsed.scheme)
    if cls is None:
        return f"scheme {parsed.scheme!r} is not one of {', '.join(schemes())}"
    if cls.IN_PROCESS:  # a pool of this process, named by the host part (url_problem)
        pass
    elif cls.LOCAL and parsed.netloc not in ("", "localhost"):
        return f"a {parsed.scheme} URL names a local directory, {cls.FORM}"
    elif cls.LOCAL and not parsed.path.startswith("/"):  # not the engine's working directory
        return f"a {parsed.scheme} URL names an absolute directory, {cls.FORM}"
    elif not cls.LOCAL and not (cls.SOCKET_PATHS and not parsed.netloc
                              and parsed.path.startswith("/")):
        try:
            port_ok = parsed.port is None or parsed.port > 0
        except ValueError:
            port_ok = False
        if not parsed.hostname or not port_ok:
            return f"a network store names HOST:PORT ({cls.FORM}), not {parsed.netloc!r}"
        why = _host_problem(parsed.hostname)
        if why:
            return why
    extra = sorted(set(options) - set(cls.option_names()))
    if extra:
        takes = cls.option_names()
        close = [m for name in extra for m in difflib.get_close_matches(name, takes, 1)]
        owners = sorted({c.FORM for c in store_classes()
                         if set(extra) & set(c.option_names())})
        return (f"option {', '.join(map(repr, extra))} is not one a {parsed.scheme}:// "
                f"store takes (its options: {', '.join(takes) or 'none'})"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + (f"; {_listed(owners)} take{'s' if len(owners) == 1 else ''} it"
                   if owners else ""))
    return _unread_part(parsed, cls) or cls.url_problem(parsed)


def _listed(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _host_problem(host: str) -> str:
    """Why ``host`` can never be looked up ("" if it may be): the resolver encodes a name
    with IDNA at the first connection, which refuses a label over 63 characters or a
    name over 253 (a ``UnicodeError`` then, not a miss)."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    try:
        encoded = host.encode("idna")
    except UnicodeError as e:
        return f"its host {host[:80]!r} is not a DNS name ({e})"
    if len(encoded.rstrip(b".")) > 253:
        return f"its host is {len(encoded)} characters; a DNS name has at most 253"
    return ""


def _unread_part(parsed: ParseResult, cls: type[ChunkStore]) -> str:
    """The first part of the URL present that its store does not read ("" if none): a
    setting written there would otherwise be dropped without a word."""
    pathname = cls.LOCAL or (cls.SOCKET_PATHS and not parsed.netloc)
    if pathname:  # read as a file name: exactly the bytes it decodes to
        try:
            path = unquote(parsed.path, errors="strict")
        except UnicodeDecodeError:
            return f"its path {parsed.path!r} has a percent-escape that is not UTF-8"
        if "\0" in path:
            return (f"its path {parsed.path!r} holds a NUL byte (at character "
                    f"{path.index(chr(0))} of the decoded path); a file name has none")
    parts = {"userinfo": _hidden(parsed.netloc.rpartition("@")[0]) if "@" in parsed.netloc
             else "",
             "path": "" if pathname or parsed.path in ("", "/") else parsed.path,
             "params": parsed.params, "query": parsed.query, "fragment": parsed.fragment}
    for part, value in parts.items():
        if not value or part in cls.URL_PARTS:
            continue
        why = f"its {part} {value!r} is not read by a {parsed.scheme}:// store ({cls.FORM})"
        settings = sorted({name for name, _ in parse_qsl(value, keep_blank_values=True)}
                          & set(options())) if (
                              part == "query") else []
        if settings:  # "file:///DIR?max_bytes=1": the capacity is a setting of its own
            return (f"{why}: {', '.join(settings)} is a setting of its own (the "
                    f"kv_connector_extra_config key {settings[0]!r}, open_store's "
                    f"{settings[0]}=), not part of the URL")
        if part in ESCAPED and pathname:
            return f"{why}; a {ESCAPED[part][0]} in a path is written {ESCAPED[part][1]}"
        return why
    return ""



def check_url(url: str, options: Sequence[str] = ()) -> None:
    """``ConfigError`` when ``url`` (with open_store keywords ``options``) names no store:
    why, and the forms the registered stores take."""
    why = url_problem(url, options)
    if why:
        shown = redacted(url)
        raise ConfigError(f"url {shown!r}: {why}; the chunk store is {url_forms()}",
                          field="url", value=shown, rule="a registered chunk store URL")


def _hidden(userinfo: str) -> str:
    """A URL's ``USER:PASSWORD`` as ``USER:***``: a password is never repeated in a
    message."""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:***" if colon else userinfo


def redacted(url: str) -> str:
    """``url`` with the password of its userinfo (if any) written ``***``."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    userinfo, _, host = netloc.rpartition("@")
    return f"{scheme}://{_hidden(userinfo)}@{host}{slash}{tail}"


def open_store(url: str, *, suffix: str = "", timeout: float | None = None,
               **options: Any) -> ChunkStore:
    """The store a URL names (see ``url_forms()``); ``suffix`` marks every key and name
    (tensor-parallel ranks); ``timeout``: seconds a network store waits on a socket, and
    the most a store from outside the package may take to open (its ``open`` then runs
    on a worker thread, so it must not need the main thread, e.g. for ``signal``; one
    that has not returned by then is given up on: ``TransportError`` naming the URL and
    the timeout);
    ``options``: those its class takes (``OPTIONS``: TLS files, ``max_bytes``).  A store
    whose ``open`` raises is a ``ConfigError`` naming its class, its entry point and the
    cause."""
    options = {k: v for k, v in options.items() if v is not None}
    check_url(url, list(options))
    parsed = urlparse(url)
    cls = store_class(parsed.scheme)
    assert cls is not None  # check_url refused any other
    kinds = {o.name: o for o in cls.OPTIONS}
    options = {k: kinds[k].parse(v, f"option {k}") if isinstance(v, str) else v
               for k, v in options.items()}  # "64G" as the connector and the CLI read it
    cls.check_options(options, lambda name: f"option {name}")
    try:
        if timeout is None or is_builtin(cls):  # the built-ins bound their sockets by it
            store = cls.open(url, parsed, timeout=timeout, **options)
        else:
            store = _open_within(cls, url, parsed, timeout, options)
    except HurrayError:
        raise
    except (OSError, UnicodeError) as e:  # a directory that cannot be made, ...
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, OSError) and e.filename:
            why += f": {e.filename}"
        raise ConfigError(f"url {url!r}: the store cannot be opened: {why}", field="url",
                          value=url, rule="a store this process can open") from None
    except (Exception, SystemExit) as e:  # a plugin's own error: named, not a traceback
        raise ConfigError(f"url {url!r}: the store cannot be opened: {describe(cls)} raised "
                          f"{type(e).__name__}: {e}", field="url", value=url,
                          rule="a store this process can open") from e
    return Suffixed(store, suffix) if suffix else store


def _open_within(cls: type[ChunkStore], url: str, parsed: ParseResult, timeout: float,
                 options: dict[str, Any]) -> ChunkStore:
    """``cls.open`` on a daemon thread, waited for ``timeout`` seconds: a plugin's open
    that hangs (a connection it never bounds) cannot hang its caller.  A store that
    opens after it was given up on is closed."""
    lock, done = threading.Lock(), threading.Event()
    outcome: list[Any] = []  # [store] or [None, the exception]

    def run() -> None:
        try:
            got: list[Any] = [cls.open(url, parsed, timeout=timeout, **options)]
        except BaseException as e:  # handed to the caller's thread
            got = [None, e]
        with lock:
            if done.is_set():  # abandoned: nobody will close it
                if got[0] is not None:
                    with contextlib.suppress(Exception):
                        got[0].close()
                return
            outcome.extend(got)
            done.set()

    threading.Thread(target=run, name=f"hurraykv open {url}", daemon=True).start()
    done.wait(timeout)
    with lock:
        if not outcome:
            done.set()
            raise TransportError(
                f"url {url!r}: the store did not open within the timeout of {timeout:g} s: "
                f"{describe(cls)} never returned from open", field="url", value=url,
                rule="a store opens within the timeout it is given")
    if len(outcome) == 2:
        raise outcome[1]
    return outcome[0]


