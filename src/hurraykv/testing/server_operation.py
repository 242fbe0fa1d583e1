"""The contract every private server operation keeps (a function served by ``hurraykv
serve`` under a name, ``hurraykv.net.extensions``: the package's, or one a distribution
declares in the entry point group ``hurraykv.server_operations``), as one pytest test
class that each operation's test class inherits.  The operation is served by a real
server in a thread (``KVServer(...).run_in_thread()``) and called by a real client
(``KVClient.extension``).  An operation gets every test below by subclassing
``ServerOperationTests`` and giving

* ``OPERATION``: the name it is served under (a class attribute),
* ``operation``: a fixture returning the function (registered under ``OPERATION`` for the
  test and unregistered after, unless it is the one registered already),
* ``cases``: a fixture returning valid payloads, each with the reply expected (bytes), or
  a function ``check(reply, fds)`` asserting what it must be (``fds``: the descriptors
  passed with it, closed after); it is given the ``client``, to store what the payloads
  name first,

and, where they differ from the defaults, ``listen`` (a fixture: where the server
listens, ``"127.0.0.1:0"``; a Unix socket's path for an operation only such a client
gets), ``MALFORMED`` (payloads refused, each with the field its refusal names) and
``TRUNCATED``, ``TRAILING``, ``EMPTY`` (False where the operation takes a payload cut
short, one with bytes after its fields, or none at all)::

    import struct

    import pytest
    from acme_ops import shout

    from hurraykv.testing import ServerOperationTests

    class TestShout(ServerOperationTests):
        OPERATION = "acme.shout"
        MALFORMED = ((struct.pack("<I", 9) + b"hi", "acme.shout.text"),)

        @pytest.fixture
        def operation(self):
            return shout

        @pytest.fixture
        def cases(self, client):
            return [(struct.pack("<I", 5) + b"hello", b"HELLO")]

A refusal is ERROR INVALID_MESSAGE whose message says ``FIELD at payload byte N: found
VALUE; RULE`` (the operation reads its payload through ``messages.payload_reader`` and
ends with ``end()``), the connection carrying on; no payload, however damaged, makes the
operation fail with ERROR INTERNAL (an exception other than a ``HurrayError``); a name the
server does not serve is ERROR UNKNOWN_OPERATION naming it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import numpy as np
import pytest

from hurraykv.net import extensions
from hurraykv.net.client import KVClient
from hurraykv.net.messages import ErrorCode, RemoteError
from hurraykv.net.server import KVServer, ServerThread

Check = Callable[[bytes, list[int]], object]
# "field at payload byte N: found V; rule" (a ProtocolError of payload_reader)
HOUSE_FORM = re.compile(r"(?P<field>\S+) at (?:payload )?byte (?P<offset>\d+): found "
                        r"(?P<value>.+?); (?P<rule>.+)", re.S)


def cuts(n: int) -> list[int]:
    """Lengths to cut an ``n``-byte payload to: each, or the first and last 32 of a long
    one (a payload of megabytes is not sent a million times)."""
    return list(range(n)) if n <= 64 else [*range(32), *range(n - 32, n)]


class ServerOperationTests:
    """Every test a private server operation passes; inherit it and give ``OPERATION``
    and the fixtures ``operation`` and ``cases`` (the module docstring says how)."""

    OPERATION: ClassVar[str]
    MALFORMED: ClassVar[Sequence[tuple[bytes, str]]] = ()
    TRUNCATED: ClassVar[bool] = True  # a valid payload cut short is refused
    TRAILING: ClassVar[bool] = True  # a valid payload with bytes after it is refused
    EMPTY: ClassVar[bool] = True  # an empty payload is refused

    @pytest.fixture
    def listen(self) -> str:
        return "127.0.0.1:0"

    @pytest.fixture
    def server(self, operation, listen: str) -> Iterator[ServerThread]:
        held = extensions.OPERATIONS.get(self.OPERATION)
        if held is not operation:
            extensions.register(self.OPERATION, operation)  # refused: another holds it
        try:
            with KVServer(listen=listen).run_in_thread() as st:
                yield st
        finally:
            if held is None:
                extensions.unregister(self.OPERATION)

    @pytest.fixture
    def client(self, server: ServerThread) -> Iterator[KVClient]:
        with KVClient(server.address, timeout=30) as c:
            yield c

    # ------------------------------------------------------------------ helpers
    def call(self, client: KVClient, payload: bytes, check: bytes | Check | None = None
             ) -> bytes:
        """The operation's reply to ``payload``, checked by ``check``; descriptors passed
        with it are closed whatever happens."""
        fds: list[int] = []
        try:
            reply = client.extension(self.OPERATION, payload, fds=fds)
            if isinstance(check, bytes | bytearray):
                assert reply == check, f"{payload.hex()}: answered {reply!r}, not {check!r}"
            elif check is not None:
                check(reply, fds)
            return reply
        finally:
            for fd in fds:
                os.close(fd)

    def refused(self, client: KVClient, payload: bytes, why: str) -> RemoteError:
        """The ERROR INVALID_MESSAGE answering ``payload`` (``why``: what is wrong with
        it), checked to say the field, its byte, the value and the rule; the connection
        answers a PING after it."""
        try:
            reply = self.call(client, payload)
        except RemoteError as e:
            assert e.code == ErrorCode.INVALID_MESSAGE, (
                f"{why} ({payload.hex()}): answered {e}; a malformed payload is "
                "INVALID_MESSAGE")
            said = HOUSE_FORM.fullmatch(e.remote_message)
            assert said is not None, (
                f"{why} ({payload.hex()}): answered {e.remote_message!r}, which does not say "
                "'FIELD at payload byte N: found VALUE; RULE'")
            assert client.ping() >= 0  # the connection carries on
            return e
        pytest.fail(f"{why} ({payload.hex()}): answered {reply!r}; it should be refused")

    def valid(self, cases: Sequence[tuple[bytes, bytes | Check]]
              ) -> Sequence[tuple[bytes, bytes | Check]]:
        """``cases``, checked to hold at least one payload."""
        assert cases, f"{type(self).__name__}.cases gives no payload"
        return cases

    # ------------------------------------------------------------------ valid payloads
    def test_each_payload_round_trips_through_a_real_server(self, client, cases):
        for payload, check in self.valid(cases):
            self.call(client, payload, check)
        for payload, check in self.valid(cases):  # and again: the first left nothing behind
            self.call(client, payload, check)

    # ------------------------------------------------------------------ refusals
    def test_a_payload_cut_short_is_refused_naming_a_field(self, client, cases):
        if not self.TRUNCATED:
            pytest.skip(f"{self.OPERATION} takes a payload cut short (TRUNCATED = False)")
        for payload, _ in self.valid(cases):
            for n in cuts(len(payload)):
                self.refused(client, payload[:n], f"cut to {n} of {len(payload)} bytes")
        self.call(client, self.valid(cases)[0][0])  # and answered, not refused

    def test_bytes_after_the_payload_are_refused_naming_a_field(self, client, cases):
        if not self.TRAILING:
            pytest.skip(f"{self.OPERATION} takes bytes after its payload (TRAILING = False)")
        for payload, _ in self.valid(cases):
            for extra in (b"\x00", b"\xff\xff\xff"):
                self.refused(client, payload + extra, f"{len(extra)} bytes after it")
        self.call(client, self.valid(cases)[0][0])

    def test_an_empty_payload_is_refused_naming_a_field(self, client, cases):
        if not self.EMPTY:
            pytest.skip(f"{self.OPERATION} takes an empty payload (EMPTY = False)")
        self.refused(client, b"", "empty")
        self.call(client, self.valid(cases)[0][0])

    def test_the_malformed_payloads_are_refused_naming_their_field(self, client, cases):
        if not self.MALFORMED:
            pytest.skip(f"{type(self).__name__}.MALFORMED lists no payload")
        for payload, field in self.MALFORMED:
            e = self.refused(client, payload, f"malformed, naming {field}")
            said = HOUSE_FORM.fullmatch(e.remote_message)
            assert said is not None and said["field"] == field, (
                f"{payload.hex()}: {e.remote_message!r} does not name {field!r}")
        self.call(client, self.valid(cases)[0][0])

    def test_no_payload_makes_it_fail_internally(self, client, cases):
        """Every valid payload cut short, with a byte changed, with bytes after it, and
        random bytes: answered, or refused with an ERROR of the operation's choosing,
        never INTERNAL (the operation raised something other than a ``HurrayError``)."""
        rng = np.random.default_rng(48)
        tried = [b"", *(rng.bytes(int(n)) for n in rng.integers(1, 64, 16))]
        for payload, _ in self.valid(cases):
            tried += [payload[:n] for n in cuts(len(payload))]
            tried += [payload + b"\x00", payload + b"\xff" * 9]
            for i in range(min(len(payload), 64)):
                for bits in (0x01, 0x80, 0xFF):
                    changed = bytearray(payload)
                    changed[i] ^= bits
                    tried.append(bytes(changed))
        for payload in tried:
            try:
                self.call(client, payload)
            except RemoteError as e:
                assert e.code != ErrorCode.INTERNAL, f"{payload.hex()}: {e}"
        assert client.ping() >= 0

    def test_a_name_the_server_does_not_serve_is_unknown_operation(self, client, cases):
        unknown = f"{self.OPERATION[:100]}.not-served"
        assert unknown not in extensions.OPERATIONS
        with pytest.raises(RemoteError) as e:
            client.extension(unknown, self.valid(cases)[0][0])
        assert e.value.code == ErrorCode.UNKNOWN_OPERATION, str(e.value)
        assert repr(unknown) in e.value.remote_message
        assert repr(self.OPERATION) not in e.value.remote_message  # no other name learnt
        assert client.ping() >= 0
        self.call(client, self.valid(cases)[0][0])


__all__ = ["Check", "ServerOperationTests"]
