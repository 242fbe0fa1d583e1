"""The contract every chunk store implements (``ChunkStore``), what its catalog lists
(``Stored``), and the registry that maps URL schemes
to store classes: the built-ins, then the entry points of group ``hurraykv.chunk_stores``
(the package docstring says how plugins are loaded and when one is skipped)."""

from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar
from urllib.parse import ParseResult, urlparse

from .. import plugins
from ..errors import HurrayError
from ..io import checksums
from ..snapshot import KVCacheSnapshot
from .settings import KINDS, Option


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


class ChunkStore(ABC):
    """Where chunks live.  ``get`` raises a HurrayError for a segment that is missing,
    truncated or does not parse."""

    url: str
    SCHEMES: ClassVar[tuple[str, ...]] = ()  # the URL schemes this class opens
    FORM: ClassVar[str] = ""  # the URL's form, for messages: "file:///DIR"
    LOCAL: ClassVar[bool] = False  # a path on this host (no HOST:PORT)
    IN_PROCESS: ClassVar[bool] = False  # this process's memory: SCHEME://[NAME]
    # its calls return within their deadlines by themselves (nothing to wait on, or
    # every wait behind a deadline of its own): a guard calls it on the caller's thread
    BOUNDED: ClassVar[bool] = False
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

    def checked_from(self, store: ChunkStore, name: str, later: frozenset[str]
                     ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        """``store.get_checked(name, later)`` (a store this one fronts), the time it spent
        verifying added to this one's ``verify_seconds``."""
        before = store.verify_seconds
        try:
            return store.get_checked(name, later)
        finally:
            self.verify_seconds += store.verify_seconds - before

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
BUILTIN = ("file.store", "server", "redis", "memory", "s3")  # modules whose classes register
GROUP = "hurraykv.chunk_stores"  # the entry point group of stores from outside the package
RESERVED = ("url", "suffix", "timeout")  # open_store's own keywords: no option's name
_LOCK = threading.RLock()
_SEEN: set[tuple[str, str, str]] = set()  # entry points loaded or skipped
_ORIGIN: dict[type, str] = {}  # a plugin's class -> its entry point, for open's messages
_SCANNED = False


class StorePluginWarning(UserWarning):
    """A store entry point was skipped (the built-ins and the other plugins still work)."""


def is_builtin(cls: type) -> bool:
    """``cls`` is one of the package's own stores."""
    return cls.__module__ in {f"{__package__}.{m}" for m in BUILTIN}


def register(cls: type[ChunkStore]) -> None:
    """Make ``cls`` the store of its ``SCHEMES`` (done when such a class is defined).  A
    scheme another class opens is refused (``TypeError``); the built-ins are imported
    before any other class registers, so theirs stay theirs."""
    with _LOCK:
        if not is_builtin(cls):
            _import_builtins()
        for scheme in cls.SCHEMES:
            owner = _REGISTRY.get(scheme)
            if owner is not None and _named(owner) != _named(cls):  # not a reload
                raise TypeError(f"{_named(cls)} names scheme {scheme!r}, which "
                                f"{'the built-in ' if is_builtin(owner) else ''}"
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
        return tuple(sorted(dict.fromkeys(c for c in _REGISTRY.values() if is_builtin(c)),
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



def describe(cls: type[ChunkStore]) -> str:
    """A store class for messages: its qualified name and, for a plugin's, its entry
    point."""
    origin = _ORIGIN.get(cls)
    return f"{_named(cls)} ({origin})" if origin else _named(cls)
