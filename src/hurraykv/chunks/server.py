"""``hurray://HOST:PORT``: segments pushed to a ``hurraykv serve``, aliases with its LINK
and LOCATE messages (one reconnect per call: the server may have restarted)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import ParseResult, unquote

from ..errors import TransportError
from ..io.checksums import Pending
from ..io.scatter import PageSource
from ..snapshot import KVCacheSnapshot
from .file.layouts import Layouts
from .keys import SEGMENT_NAME, check_name, identity_key, segment_name, valid_name
from .registry import ChunkStore, Stored
from .settings import Option

# A segment's identity, kept by the server as an alias it drops with the segment:
# LABELS + identity_key + "/" + segment name -> the segment (``catalog``).
LABELS = "hurraykv-ids/"


class ServerChunks(ChunkStore):
    SCHEMES = ("hurray",)
    FORM = "hurray://HOST:PORT"
    OPTIONS = (Option("tls_cert", "str", "Client certificate for a server with mutual TLS."),
               Option("tls_key", "str", "Its private key."),
               Option("tls_ca", "str", "The CA that signed the server's certificate."),
               Option("server_hostname", "str", "The name the server's certificate must "
                      "carry."))
    SOCKET_PATHS = True

    @classmethod
    def check_options(cls, options: Mapping[str, Any], named: Callable[[str], str]) -> None:
        """The TLS files: readable, PEM of their kind, the key the certificate's."""
        from ..net.tls import client_context

        client_context(options.get("tls_cert"), options.get("tls_key"),
                       options.get("tls_ca"),
                       names={kind: named(f"tls_{kind}") for kind in ("cert", "key", "ca")})

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> ServerChunks:
        if timeout is not None:
            options["timeout"] = timeout
        return cls(parsed.netloc or unquote(parsed.path), **options)

    def __init__(self, address: str, prefix: str = "hurraykv-chunks/", **client: Any) -> None:
        self.address, self.prefix, self._opts = address, prefix, client
        self.url = f"hurray://{address}"
        self._client: Any = None
        self._share = True  # hand-overs asked for until a connection cannot have them
        self._layouts = Layouts()

    def _call(self, fn: Any) -> Any:
        from ..net.client import KVClient

        for attempt in (0, 1):  # one reconnect: the server may have restarted
            try:
                if self._client is None:
                    self._client = KVClient(self.address, **self._opts)
                return fn(self._client)
            except TransportError:
                self.close()
                if attempt:
                    raise
        raise AssertionError

    def connect(self) -> None:
        self._call(lambda c: c.ping() if hasattr(c, "ping") else None)

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        names = self._call(lambda c: c.locate([self.prefix + k for k in keys]))
        return [valid_name(None if n is None else n.removeprefix(self.prefix)) for n in names]

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = self.prefix + segment_name(keys, first)
        snapshot = snapshot.with_info(metadata=metadata)  # carried as the file store does
        links = [(self.prefix + k, name) for k in keys]
        if snapshot.model:  # the server reads no snapshot: its identity goes as a label
            links.append((f"{LABELS}{identity_key(snapshot.model)}/{name}", name))
        self._call(lambda c: (c.push(name, snapshot), c.link(links)))

    def catalog(self) -> list[Stored]:
        """The server's segments (LIST) and their identities (the labels, ALIASES); it
        records no times, and a segment stored before labels were written has no
        identity (``cache clear --all`` removes it)."""
        objects, labels, kept = self._call(lambda c: (
            c.list_keys(self.prefix), c.aliases(LABELS), c.retention(self.prefix)))
        of = {target: alias[len(LABELS):].partition("/")[0] for alias, target in labels}
        return [Stored(key.removeprefix(self.prefix), nbytes, of.get(key),
                       pinned=bool(kept.get(key, (False,))[0]),
                       expiry=kept[key][1] if key in kept else None)
                for key, nbytes in objects
                if SEGMENT_NAME.fullmatch(key.removeprefix(self.prefix))]

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        from ..io.retention import PinRefused, ttl_seconds
        from ..net.messages import ErrorCode, RemoteError

        keys = [self.prefix + check_name(n) for n in names]
        if ttl_s is not None:  # refused here by field, as the server would by message only
            ttl_s = ttl_seconds(ttl_s)
        try:
            done = self._call(lambda c: c.retain(keys, pin=pin, ttl_s=ttl_s, extend=extend))
        except RemoteError as e:
            if e.code != ErrorCode.STORE_FULL:
                raise
            raise PinRefused(f"{self.url}: {e}", field="max_pinned_bytes",
                             rule="pinned bytes stay within the server's "
                                  "--max-pinned-bytes") from None
        return [k.removeprefix(self.prefix) for k in done]

    def remove(self, name: str) -> bool:
        from ..net.messages import ErrorCode, RemoteError

        try:
            self._call(lambda c: c.delete(self.prefix + check_name(name)))
        except RemoteError as e:
            if e.code != ErrorCode.UNKNOWN_TENSOR:
                raise
            return False
        return True

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        return self._call(lambda c: c.has([self.prefix + check_name(n) for n in names]))

    def get(self, name: str) -> KVCacheSnapshot:
        return self._call(lambda c: c.pull(self.prefix + name))

    def get_verified(self, name: str) -> KVCacheSnapshot:
        """``get``, every page hashed as it is received (``KVClient.pull(verify=True)``):
        no pass over the segment after the transfer."""
        def pull(c: Any) -> KVCacheSnapshot:
            try:
                return c.pull(self.prefix + check_name(name), verify=True)
            finally:
                self.verify_seconds += c.last_verify_seconds

        return self._call(pull)

    def get_pages(self, name: str, members: frozenset[str]
                  ) -> tuple[KVCacheSnapshot, PageSource] | None:
        """From a server on this host (its Unix socket, without TLS): the segment's file
        handed over as a sealed memory file (``net/handover.py``) and read as a
        ``file://`` segment is, the pages of ``members`` left in it for ``io.scatter`` to
        place (``FileChunks.get_pages``).  None where the server is elsewhere or hands
        nothing over (it does not serve ``hurraykv.share``): the caller pulls."""
        from ..io import scatter
        from ..net import handover
        from ..net.messages import ErrorCode, RemoteError

        check_name(name)
        if not self._share or not scatter.available():
            return None

        def take(c: Any) -> handover.Sealed | None:
            if not handover.can_receive(c):
                return None
            try:
                return handover.receive(c, self.prefix + name)
            except RemoteError as e:
                if e.code not in (ErrorCode.UNKNOWN_OPERATION, ErrorCode.INVALID_MESSAGE):
                    raise
                return None

        sealed = self._call(take)
        if sealed is None:
            self._share = False  # asked once a connection
            return None
        got = self._layouts.pages(sealed.fd, name, f"segment {name} from {self.url}",
                                  members)
        if got is None:
            sealed.close()
            return None
        sealed.close.detach()  # the descriptor is the PageSource's now
        snap, source, seconds = got
        self.verify_seconds += seconds
        return snap, source

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, Pending | None]:
        """Everything checked as it arrived, ``later`` members too (hashing a page in
        cache costs less than leaving it for a second pass): nothing pending."""
        return self.get_verified(name), None

    def discard(self, name: str) -> None:
        self._call(lambda c: c.delete(self.prefix + check_name(name)))

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        self._share = True  # a new connection may reach a server that hands over


__all__ = ["ServerChunks"]
