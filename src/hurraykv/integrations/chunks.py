"""KV chunks by content: the keys and the stores the engine connectors share.

A chunk is ``chunk_size`` consecutive tokens of one sequence (whole engine blocks).  Its
key chains a 128-bit BLAKE2b digest over all tokens from the start of the sequence to the
chunk's end, seeded with the cache's identity (model, dtype, geometry, chunk size)::

    h_0 = BLAKE2b-128("hurraykv-chunks-v1" | identity)
    h_k = BLAKE2b-128(h_(k-1) | tokens of chunk k as int64 little-endian)

so two requests that share their first N tokens share the keys of their first
``N // chunk_size`` chunks, and chunks of another model or dtype never match.

Chunks are stored in *segments*: one KVCacheSnapshot of one sequence holding a run of
consecutive chunks (every layer's key and value pages), named ``LASTKEY-FIRST`` after the
key of its last chunk and the index of its first, with every chunk key of the run made an
alias of it.  A request's new chunks cost one object however many there are, and a later
request sharing any whole-chunk prefix still finds each chunk by its own key.

Stores, one class per URL scheme, registered by the schemes it declares (``SCHEMES``):
``file_store.FileChunks`` (``file:///DIR``: ``DIR/NAME.hrry``, each a .hrry snapshot that
``hurraykv inspect`` and ``hk.load_snapshot`` read; the aliases are lines of
``DIR/aliases.log``), ``server_store.ServerChunks`` (``hurray://HOST:PORT``: a ``hurraykv
serve``; aliases with its LINK and LOCATE messages), ``redis_store.RedisChunks``
(``redis://HOST:PORT``, ``rediss://``, ``redis+cluster://HOST:PORT``: the PageStore,
identical pages of different segments stored once; aliases as small keys).  A new backend
is one ``ChunkStore`` subclass naming its schemes and the settings it takes besides its
URL (``OPTIONS``: each an ``Option`` of a kind the connector's config parses), plus a test
class that inherits the contract (``hurraykv.testing.ChunkStoreTests``); ``open_store``,
its error messages and the connector's config check list what is registered, and refuse a
part of a URL (userinfo, path, query, fragment) that its class does not read
(``URL_PARTS``), so that no setting written there is dropped without a word.

A store from outside the package registers through the entry point group
``hurraykv.chunk_stores`` (``toy = my_package.toy_store`` or ``...:ToyChunks``: a module
whose ``ChunkStore`` subclasses register as they are defined, or one such class).  The
built-in modules (``BUILTIN``) are imported first, then every entry point once, lazily, on
the first use of the registry (``load_plugins`` again takes in distributions installed
since).  A plugin never breaks the built-ins: one that fails to import, names no store
class or names a scheme already taken (a built-in's scheme stays the built-in's) is
skipped with a ``StorePluginWarning`` naming the entry point, its distribution and why.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import ipaddress
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar
from urllib.parse import ParseResult, parse_qsl, unquote, urlparse

import numpy as np

from .. import plugins, units
from ..errors import ConfigError, HurrayError, TransportError
from ..io import checksums
from ..snapshot import KVCacheSnapshot

SEED = b"hurraykv-chunks-v1"
DIGEST = 16
# A chunk key: the hex digest, with ``.tpRANK`` for one tensor-parallel rank's objects; a
# segment name: its last chunk's key and its first chunk's index.
KEY = rb"[0-9a-f]{32}(?:\.tp[0-9]{1,4})?"
SEGMENT_NAME = re.compile(KEY.decode() + r"-[0-9]{1,9}")
ALIAS_LINE = re.compile(rb"(" + KEY + rb") (" + KEY + rb"-[0-9]{1,9})")


def check_name(name: str) -> str:
    """``name`` if it is a segment name (so a path built from it stays in the store's
    directory), else a HurrayError naming the rule."""
    if not isinstance(name, str) or SEGMENT_NAME.fullmatch(name) is None:
        raise HurrayError(f"segment name {name!r} is not KEY-FIRST (32 hex digits, an "
                          "optional .tpRANK, '-', the first chunk's index)", field="segment",
                          value=name, rule="the segment-name grammar")
    return name


def identity_digest(identity: str) -> bytes:
    return hashlib.blake2b(SEED + identity.encode("utf-8"), digest_size=DIGEST).digest()


def chain(previous: bytes, tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """The chained digests of each whole chunk of ``tokens``, continuing ``previous``."""
    full = len(tokens) // chunk_size
    data = np.ascontiguousarray(np.asarray(tokens[:full * chunk_size], dtype="<i8"))
    out = []
    for row in data.reshape(full, chunk_size) if full else ():
        previous = hashlib.blake2b(previous + row.tobytes(), digest_size=DIGEST).digest()
        out.append(previous)
    return out


class ChunkKeys:
    """The keys of one growing sequence, computed once per chunk."""

    def __init__(self, seed: bytes, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._digests: list[bytes] = []
        self._seed = seed

    def upto(self, tokens: Sequence[int], count: int) -> list[str]:
        """Keys of the first ``count`` chunks (``tokens`` holds at least that many)."""
        have = len(self._digests)
        if count > have:
            start = have * self.chunk_size
            prev = self._digests[-1] if self._digests else self._seed
            self._digests += chain(prev, tokens[start:count * self.chunk_size], self.chunk_size)
        return [d.hex() for d in self._digests[:count]]


def valid_name(name: str | None) -> str | None:
    """A name a store returned, or None (a miss) when it is not a segment name."""
    return name if name is not None and SEGMENT_NAME.fullmatch(name) else None


def segment_name(keys: Sequence[str], first: int) -> str:
    return f"{keys[-1]}-{first}"


def segment_ends_at(name: str, key: str) -> bool:
    """Segment ``name`` ends with chunk ``key`` (its name is its last key and first index)."""
    return name.rpartition("-")[0] == key


def segment_first(name: str) -> int:
    """The index of a segment's first chunk, from its name (checked)."""
    return int(check_name(name).rsplit("-", 1)[1])


@dataclass(frozen=True)
class Stored:
    """One segment as ``ChunkStore.catalog`` lists it: its name, its bytes, the cache
    identity it was stored under (``identity``: the string, where the store keeps it;
    ``identity_key``: ``identity_digest(identity).hex()``, which every store knows) and,
    where the store records them, when it was stored and last used (Unix seconds)."""

    name: str
    nbytes: int
    identity_key: str | None = None
    identity: str | None = None
    created: float | None = None
    used: float | None = None
    pinned: bool = False  # never evicted to make room (``ChunkStore.retain``)
    expiry: float | None = None  # a miss from then on (Unix seconds)
    version: Any = None  # tells this object from one stored again under its name


def identity_key(identity: str) -> str:
    """How a catalog names an identity: its digest, 32 hex digits."""
    return identity_digest(identity).hex()


KINDS = ("str", "size", "int", "float", "bool")


@dataclass(frozen=True)
class Option:
    """A setting a store class takes besides its URL (``ChunkStore.OPTIONS``): the
    ``open_store`` keyword ``name``, and the connector's ``kv_connector_extra_config`` key
    of that name.  ``kind`` says how the connector reads it: ``"str"`` (a non-empty string:
    a name, a file), ``"size"`` (bytes, or text like ``"64G"``), ``"int"`` or ``"float"``
    (positive) or ``"bool"``; a store is given only the options set (never None)."""

    name: str
    kind: str = "str"
    doc: str = ""

    def parse(self, text: str, named: str) -> Any:
        """``text`` (a command line's) read as this option's kind; a ``ConfigError``
        naming it as ``named`` (``--option bucket``) and the rule when it is not."""
        rules = {"str": "a non-empty string", "size": "a positive byte count or a size "
                 "like 64G, in ASCII digits", "int": "a positive integer in ASCII digits",
                 "float": "a positive number in ASCII digits", "bool": "true or false"}
        value: Any = None
        with contextlib.suppress(ValueError, OverflowError):
            if self.kind == "str":
                value = text if text.strip() else None
            elif self.kind == "bool":
                value = {"true": True, "false": False}.get(text.strip().lower())
            else:
                number = {"size": units.parse_size, "int": units.parse_int,
                          "float": units.parse_float}[self.kind](text)
                value = number if 0 < number < float("inf") else None
        if value is None:
            raise ConfigError(f"{named} is {text!r}; it is {rules[self.kind]}",
                              field=self.name, value=text, rule=rules[self.kind])
        return value


class ChunkStore(ABC):
    """Where chunks live.  ``get`` raises a HurrayError for a segment that is missing,
    truncated or does not parse."""

    url: str
    SCHEMES: ClassVar[tuple[str, ...]] = ()  # the URL schemes this class opens
    FORM: ClassVar[str] = ""  # the URL's form, for messages: "file:///DIR"
    LOCAL: ClassVar[bool] = False  # a path on this host (no HOST:PORT)
    SOCKET_PATHS: ClassVar[bool] = False  # also SCHEME:///path of a Unix socket
    # the open_store keywords (and connector config keys) it takes besides timeout, each
    # an Option (a plain name is an Option of kind "str")
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    # the option that bounds what it holds, if it has one: unset, the connector warns
    CAPACITY: ClassVar[str | None] = None
    # the URL parts it reads besides its scheme and HOST:PORT (or path): of "userinfo",
    # "path", "query"; any other part present is refused, never silently dropped
    URL_PARTS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class naming ``SCHEMES`` (in its own body: a subclass of a store inherits
        none) is registered for them, and must define the classmethod ``open(url, parsed,
        *, timeout, **options)`` building its store of ``url`` (``options``: those in
        ``OPTIONS``)."""
        super().__init_subclass__(**kwargs)
        if not vars(cls).get("SCHEMES"):  # a subclass of a store opens nothing of its own
            return
        if not callable(getattr(cls, "open", None)):
            raise TypeError(f"{cls.__name__} names SCHEMES {cls.SCHEMES} but defines no "
                            "classmethod open(url, parsed, *, timeout, **options)")
        cls.OPTIONS = tuple(Option(o) if isinstance(o, str) else o for o in cls.OPTIONS)
        for option in cls.OPTIONS:
            if not isinstance(option, Option) or option.kind not in KINDS or \
                    option.name in RESERVED:
                raise TypeError(f"{cls.__name__}.OPTIONS holds {option!r}: an option is an "
                                f"Option of kind {', '.join(KINDS)}, named other than "
                                f"{', '.join(RESERVED)}")
        if cls.CAPACITY is not None and cls.CAPACITY not in cls.option_names():
            raise TypeError(f"{cls.__name__}.CAPACITY {cls.CAPACITY!r} is not in its OPTIONS")
        register(cls)

    @abstractmethod
    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """The segment holding each chunk key (None: not stored)."""

    @abstractmethod
    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        """Store a segment of the chunks ``keys`` (``first``: the index of ``keys[0]``)."""

    @abstractmethod
    def get(self, name: str) -> KVCacheSnapshot: ...

    verify_seconds = 0.0  # spent checking checksums in get_verified, all calls together
    evictions = 0  # segments this object evicted to stay in its capacity

    def get_verified(self, name: str) -> KVCacheSnapshot:
        """``get``, the stored values checked against the checksums written with them:
        ``ChecksumError`` (a ``HurrayError``) when they do not match or there are none."""
        snap = self.get(name)
        started = time.perf_counter()
        checksums.verify(snap, f"segment {name}")
        self.verify_seconds += time.perf_counter() - started
        return snap

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        """``get_verified``, except that the checks of the ``later`` members may be left to
        the caller (the ``Pending`` returned, None when nothing was left)."""
        return self.get_verified(name), None

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(o.name for o in cls.OPTIONS)

    @classmethod
    def check_options(cls, options: Mapping[str, Any], named: Callable[[str], str]) -> None:
        """Refuse (a ``HurrayError``) what ``options`` (the ``OPTIONS`` given, parsed) say
        that would only fail later, when the store first opens (a file that is not
        there); ``named(option)``: the option as the caller's user wrote it (a config
        key, a command-line flag), for the message."""
        return None

    @classmethod
    def url_problem(cls, parsed: ParseResult) -> str:
        """Why the parts of its URL this class reads (``URL_PARTS``) say nothing it can
        use ("" if they do); the form common to all is checked before."""
        return ""

    def has(self, keys: Sequence[str]) -> list[bool]:
        return [name is not None for name in self.locate(keys)]

    def connect(self) -> None:
        """Open the connection now (and import what it needs), not on the first call."""
        return None

    # -- what is stored (``hurraykv cache ls|clear``, the connector's reset_cache and
    # -- its removal events) --------------------------------------------------------------
    def catalog(self) -> list[Stored]:
        """Every segment stored, with its identity (``Stored``)."""
        raise HurrayError(f"a {self.FORM} store cannot list what it holds", field="url",
                          value=getattr(self, "url", None), rule="a store that lists")

    def remove(self, name: str) -> bool:
        """Delete segment ``name`` (its aliases stop reaching it); False if it was not
        stored."""
        raise HurrayError(f"a {self.FORM} store cannot delete", field="url",
                          value=getattr(self, "url", None), rule="a store that deletes")

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Which of the segments ``names`` are still stored (one round trip where the
        store batches)."""
        raise HurrayError(f"a {self.FORM} store cannot tell what it holds", field="url",
                          value=getattr(self, "url", None), rule="a store that lists")

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Pin the segments ``names`` (never evicted to make room, within the store's
        pinned-bytes budget) and give them a lifetime (``ttl_s`` seconds from now: a miss
        after it), as ``io.retention.merged`` says: set (an operator's: ``pin`` True or
        False, None leaves it; ``ttl_s`` None: no lifetime) or, ``extend``, a request's
        ask (a pin only added, a lifetime only made later).  Returns the names retained
        (those stored); a pin past the budget raises ``PinRefused`` and changes nothing."""
        raise HurrayError(f"a {self.FORM} store cannot pin or expire segments",
                          field="url", value=getattr(self, "url", None),
                          rule="a store that retains")

    def removals(self, notify: Callable[[list[str]], None], stop: Any) -> bool:
        """Tell ``notify`` the names of segments removed, as the store removes them, on a
        thread of its own until ``stop`` (a ``threading.Event``) is set; False where the
        store sends no such notices (the removal watch then polls only)."""
        return False

    def clear(self, identity: str | None) -> list[Stored]:
        """Remove every segment of ``identity`` (an ``identity_key``; None: every
        segment), then list the store again: a ``HurrayError`` names a segment listed
        before that is still there, the same object (a segment stored again meanwhile,
        another version, is a later engine's and survives; a store that gives no version
        acknowledged each removal).  Returns what was removed."""
        def chosen(s: Stored) -> bool:
            return identity is None or s.identity_key == identity

        listed = {s.name: s for s in self.catalog() if chosen(s)}
        removed = [s for s in listed.values() if self.remove(s.name)]
        left = [s.name for s in self.catalog() if s.name in listed
                and s.version is not None and s.version == listed[s.name].version]
        if left:
            raise HurrayError(f"{len(left)} segments of {identity or 'any identity'} are "
                              f"still in {self.url} after their removal, e.g. {left[0]}",
                              field="segment", value=left[0], rule="a cleared store")
        return removed

    def discard(self, name: str) -> None:
        """Take a damaged segment out of the store, so it is not read again (its chunks
        are stored again once recomputed)."""
        return None

    def close(self) -> None:
        return None


_REGISTRY: dict[str, type[ChunkStore]] = {}
BUILTIN = ("file_store", "server_store", "redis_store")  # modules whose classes register
GROUP = "hurraykv.chunk_stores"  # the entry point group of stores from outside the package
RESERVED = ("url", "suffix", "timeout")  # open_store's own keywords: no option's name
_LOCK = threading.RLock()
_SEEN: set[tuple[str, str, str]] = set()  # entry points loaded or skipped
_ORIGIN: dict[type, str] = {}  # a plugin's class -> its entry point, for open's messages
_SCANNED = False


class StorePluginWarning(UserWarning):
    """A store entry point was skipped (the built-ins and the other plugins still work)."""


def _builtin(cls: type) -> bool:
    return cls.__module__ in {f"{__package__}.{m}" for m in BUILTIN}


def register(cls: type[ChunkStore]) -> None:
    """Make ``cls`` the store of its ``SCHEMES`` (done when such a class is defined).  A
    scheme another class opens is refused (``TypeError``); the built-ins are imported
    before any other class registers, so theirs stay theirs."""
    with _LOCK:
        if not _builtin(cls):
            _import_builtins()
        for scheme in cls.SCHEMES:
            owner = _REGISTRY.get(scheme)
            if owner is not None and _named(owner) != _named(cls):  # not a reload
                raise TypeError(f"{_named(cls)} names scheme {scheme!r}, which "
                                f"{'the built-in ' if _builtin(owner) else ''}"
                                f"{_named(owner)} opens already")
        _REGISTRY.update(dict.fromkeys(cls.SCHEMES, cls))


def unregister(cls: type[ChunkStore]) -> None:
    """Forget ``cls``: its schemes name no store any more."""
    with _LOCK:
        for scheme in [s for s, c in _REGISTRY.items() if c is cls]:
            del _REGISTRY[scheme]


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_builtins() -> None:
    for module in BUILTIN:
        importlib.import_module(f"{__package__}.{module}")


def load_plugins() -> list[str]:
    """Load the store entry points (group ``hurraykv.chunk_stores``) not loaded before;
    the registry does this once, on its first use.  Returns what was skipped (also each
    a ``StorePluginWarning``): an entry point that fails to import, names no
    ``ChunkStore`` class with ``SCHEMES``, or a scheme already taken; a skipped plugin's
    classes are unregistered, and the built-ins are untouched."""
    global _SCANNED
    with _LOCK:  # another thread's first use waits for the whole registry
        _import_builtins()
        problems = plugins.load(GROUP, _load, StorePluginWarning, _SEEN)
        _SCANNED = True
    return problems


def _load(ep: metadata.EntryPoint) -> str:
    """Why entry point ``ep`` registers no store ("" if it does); what it registered
    before failing is unregistered."""
    before = dict(_REGISTRY)
    try:
        loaded = ep.load()
    except BaseException:
        for scheme in set(_REGISTRY) - set(before):
            del _REGISTRY[scheme]
        raise
    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
    for cls in set(_REGISTRY.values()) - set(before.values()):
        _ORIGIN[cls] = f"the {GROUP} entry point {ep.name!r} of {dist}"
    if isinstance(loaded, type):
        ok = issubclass(loaded, ChunkStore) and bool(loaded.SCHEMES) and all(
            _REGISTRY.get(s) is loaded for s in loaded.SCHEMES)
    else:
        ok = set(_REGISTRY) != set(before) or any(
            c.__module__ == getattr(loaded, "__name__", None) for c in _REGISTRY.values())
    return "" if ok else f"{loaded!r} is no ChunkStore class naming SCHEMES, nor a " \
        "module defining one"


def _registered() -> dict[str, type[ChunkStore]]:
    """Scheme -> class, the built-ins first in ``BUILTIN``'s order (whatever imported one
    first), then the others as they registered."""
    if not _SCANNED:
        load_plugins()
    with _LOCK:
        rank = {f"{__package__}.{m}": i for i, m in enumerate(BUILTIN)}
        return dict(sorted(_REGISTRY.items(),
                           key=lambda item: rank.get(item[1].__module__, len(rank))))


def schemes() -> tuple[str, ...]:
    """Every URL scheme a store class is registered for (the built-ins' first)."""
    return tuple(_registered())


def store_class(scheme: str) -> type[ChunkStore] | None:
    return _registered().get(scheme)


def store_classes(plugins: bool = True) -> tuple[type[ChunkStore], ...]:
    """The registered store classes, each once (the built-ins first); ``plugins`` False:
    the built-ins only (no entry point loaded)."""
    if not plugins:
        _import_builtins()
        rank = {f"{__package__}.{m}": i for i, m in enumerate(BUILTIN)}
        return tuple(sorted(dict.fromkeys(c for c in _REGISTRY.values() if _builtin(c)),
                            key=lambda c: rank[c.__module__]))  # whatever imported first
    return tuple(dict.fromkeys(_registered().values()))


def options() -> dict[str, Option]:
    """Every option a registered store class takes (the first class's, where two name
    one)."""
    out: dict[str, Option] = {}
    for cls in store_classes():
        for option in cls.OPTIONS:
            out.setdefault(option.name, option)
    return out


def is_local(url: str) -> bool:
    """Whether the store ``url`` names keeps its segments on this host (its class's
    ``LOCAL``: vLLM's ``Locality`` and cache-hit source, the synchronous loads)."""
    cls = store_class(urlparse(url).scheme)
    return cls is not None and cls.LOCAL


def url_forms() -> str:
    """The registered URL forms, for messages: ``file:///DIR, hurray://HOST:PORT, ...``."""
    forms = list(dict.fromkeys(cls.FORM for cls in _registered().values()))
    return ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else forms[0]


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
    if cls.LOCAL and parsed.netloc not in ("", "localhost"):
        return f"a {parsed.scheme} URL names a local directory, {cls.FORM}"
    if cls.LOCAL and not parsed.path.startswith("/"):  # not the engine's working directory
        return f"a {parsed.scheme} URL names an absolute directory, {cls.FORM}"
    if not cls.LOCAL and not (cls.SOCKET_PATHS and not parsed.netloc
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
                + (f"; {' and '.join(owners)} take{'s' if len(owners) == 1 else ''} it"
                   if owners else ""))
    return _unread_part(parsed, cls) or cls.url_problem(parsed)


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
    parts = {"userinfo": parsed.netloc.rpartition("@")[0] if "@" in parsed.netloc else "",
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


def suffixed(name: str, suffix: str) -> str:
    """Segment ``name`` as a store whose keys carry ``suffix`` names it (a rank's)."""
    key, _, first = name.rpartition("-")
    return f"{key}{suffix}-{first}"


class Suffixed(ChunkStore):
    """A store whose keys and segment names all carry ``suffix`` (one tensor-parallel
    rank's objects beside the others'); callers see the plain names."""

    def __init__(self, store: ChunkStore, suffix: str) -> None:
        self.inner, self.suffix, self.url = store, suffix, store.url

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        names = self.inner.locate([k + self.suffix for k in keys])
        return [None if n is None else self._plain(n) for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        self.inner.put([k + self.suffix for k in keys], first, snapshot, metadata)

    def get(self, name: str) -> KVCacheSnapshot:
        return self.inner.get(self._named(name))

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self.inner.evictions

    def get_verified(self, name: str) -> KVCacheSnapshot:
        return self.get_checked(name)[0]

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        before = self.inner.verify_seconds
        try:
            return self.inner.get_checked(self._named(name), later)
        finally:
            self.verify_seconds += self.inner.verify_seconds - before

    def connect(self) -> None:
        self.inner.connect()

    def catalog(self) -> list[Stored]:  # every rank's: a reset clears them all
        return self.inner.catalog()

    def remove(self, name: str) -> bool:
        return self.inner.remove(name)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return self.inner.exists([self._named(n) for n in names])

    def removals(self, notify: Callable[[list[str]], None], stop: Any) -> bool:
        def mine(names: list[str]) -> None:
            notify([self._plain(n) for n in names if n.rpartition("-")[0].endswith(
                self.suffix)])

        return self.inner.removals(mine, stop)

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        done = self.inner.retain([self._named(n) for n in names], pin=pin, ttl_s=ttl_s,
                                 extend=extend)
        return [self._plain(n) for n in done]

    def discard(self, name: str) -> None:
        self.inner.discard(self._named(name))

    def _named(self, name: str) -> str:
        return suffixed(name, self.suffix)

    def _plain(self, name: str) -> str:
        key, _, first = name.rpartition("-")
        return f"{key.removesuffix(self.suffix)}-{first}"

    def close(self) -> None:
        self.inner.close()


def check_url(url: str, options: Sequence[str] = ()) -> None:
    """``ConfigError`` when ``url`` (with open_store keywords ``options``) names no store:
    why, and the forms the registered stores take."""
    why = url_problem(url, options)
    if why:
        raise ConfigError(f"url {url!r}: {why}; the chunk store is {url_forms()}",
                          field="url", value=url, rule="a registered chunk store URL")


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
        if timeout is None or _builtin(cls):  # the built-ins bound their sockets by it
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
        raise ConfigError(f"url {url!r}: the store cannot be opened: {_who(cls)} raised "
                          f"{type(e).__name__}: {e}", field="url", value=url,
                          rule="a store this process can open") from e
    return Suffixed(store, suffix) if suffix else store


def _who(cls: type[ChunkStore]) -> str:
    origin = _ORIGIN.get(cls)
    return f"{_named(cls)} ({origin})" if origin else _named(cls)


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
                f"{_who(cls)} never returned from open", field="url", value=url,
                rule="a store opens within the timeout it is given")
    if len(outcome) == 2:
        raise outcome[1]
    return outcome[0]


__all__ = ["GROUP", "ChunkKeys", "ChunkStore", "Option", "StorePluginWarning", "Stored",
           "chain", "identity_digest", "identity_key", "is_local", "load_plugins",
           "open_store", "options", "register", "schemes", "segment_ends_at",
           "segment_first", "segment_name", "store_class", "store_classes", "unregister",
           "url_forms", "url_problem", "valid_name"]
