"""Private operations: what a ``hurraykv serve`` answers inside the EXTENSION envelope
(message type 0xFE marked by ``EXTENSION_MARK``; decision H95).

Every private type number (0xF0-0xFE) is taken, so a private operation added since RETAIN
is a *name* in this registry, not a message type: one :func:`register` call and its
function, no edit of ``messages.py``, ``codecs.py`` or ``handlers.py``.  An operation is
``operation(session, payload) -> reply``: ``session`` is the :class:`~.session.Session`
of the connection (its tenant, ``key()`` for tenant-scoped keys, ``server.store``),
``payload`` the bytes the client put after the operation's name, and the reply the bytes
sent back in an envelope naming the same operation.  It may instead return an awaitable
of those bytes (it then runs on the event loop, its answer sent when it completes).  It
raises :class:`~.messages.ProtocolError` to answer with ERROR (its ``code``); anything
else it raises is ERROR INTERNAL naming the exception, logged, the connection and the
server carrying on: ``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``,
``asyncio.CancelledError`` and every other ``BaseException`` included (an operation
cannot stop the server, nor drop its connection).  Only an awaitable cancelled because its
connection closed goes unanswered.  A connection has at most ``MAX_IN_FLIGHT`` (64)
operations awaiting their answer at a time: an envelope arriving while it has that many
is answered with ERROR SERVER_BUSY naming the operation and the limit, without running,
and the connection carries on.  An envelope naming an operation not registered is
answered with ERROR UNKNOWN_OPERATION naming it, and the connection carries on.  A reply
may pass descriptors with it (a :class:`Handover`, to a client on a Unix socket without
TLS: ``hurraykv.share``).

Operations are registered for the process (every server in it), like
``handlers.HANDLERS``; ``KVClient.extension(name, payload)`` calls one.  Names are 1 to 128
ASCII letters, digits, ``.``, ``_`` or ``-``; ``vendor.operation`` by convention, and
``hurraykv.*`` is this package's.  An operation from another distribution reaches
``hurraykv serve`` through the entry point group ``hurraykv.server_operations``: each entry
names a function (served under the entry's name) or a module (which registers on import),
loaded when a server starts (``load_plugins``); one that fails is skipped with an
``OperationPluginWarning`` naming it, and the server serves the others.  An operation
reads its payload through ``messages.payload_reader(payload, name)`` and ends with
``end()``, so trailing bytes are refused as a malformed payload.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from .. import plugins
from ..errors import HurrayError
from .codecs import frame
from .messages import (
    HEADER,
    ErrorCode,
    MessageType,
    ProtocolError,
    code_of,
)
from .private import OPERATION_RULE, Extension, valid_operation

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("hurraykv.server")



@dataclass(frozen=True)
class Handover:
    """A reply with descriptors passed alongside it (``SCM_RIGHTS``; only to a client on a
    Unix socket without TLS, ``Session.can_pass_fds``).  ``keep``: what holds the
    descriptors open until the reply is sent."""

    payload: bytes
    fds: list[int]
    keep: Any = None


Reply = bytes | bytearray | memoryview | Handover
Operation = Callable[["Session", bytes], "Reply | Awaitable[Reply]"]

OPERATIONS: dict[str, Operation] = {}
# Awaitable operations of one connection not yet answered: each holds its task, payload
# and whatever it awaits, so a client pipelining envelopes must not hold unbounded memory.
MAX_IN_FLIGHT = 64
GROUP = "hurraykv.server_operations"  # plugins: a function (by the entry's name) or a module
_SEEN: set[tuple[str, str, str]] = set()


class OperationPluginWarning(UserWarning):
    """An entry point of ``hurraykv.server_operations`` that was skipped, and why."""


def register(name: str, operation: Operation | None = None, *, replace: bool = False) -> Any:
    """Serve ``operation`` under ``name`` (``register(name)`` alone is a decorator).  A
    name already registered is refused unless ``replace``; a name that breaks
    ``OPERATION_RULE`` is refused."""
    if not valid_operation(name):
        raise HurrayError(f"private operation {name!r}: {OPERATION_RULE}", field="operation",
                          value=name, rule=OPERATION_RULE)

    def add(op: Operation) -> Operation:
        if not callable(op):
            raise HurrayError(f"private operation {name!r}: {op!r} is not callable; an "
                              "operation is a function (session, payload) -> bytes",
                              field="operation", value=name, rule="a callable operation")
        if name in OPERATIONS and not replace and OPERATIONS[name] is not op:
            raise HurrayError(f"private operation {name!r} is already registered "
                              f"({OPERATIONS[name]!r}); unregister it first or pass "
                              "replace=True", field="operation", value=name,
                              rule="one operation per name")
        OPERATIONS[name] = op
        return op

    return add if operation is None else add(operation)


def unregister(name: str) -> None:
    """Serve ``name`` no more (nothing if it is not registered)."""
    OPERATIONS.pop(name, None)


def load_plugins() -> list[str]:
    """Register the operations of the ``hurraykv.server_operations`` entry points not
    loaded before; returns what was skipped (also each an ``OperationPluginWarning``): an
    entry that fails to import, registers nothing, or takes a name already served."""
    return plugins.load(GROUP, _load, OperationPluginWarning, _SEEN)


def _load(ep: metadata.EntryPoint) -> str:
    """Why ``ep`` serves no operation ("" when it does)."""
    before = set(OPERATIONS)
    loaded = ep.load()
    if not inspect.ismodule(loaded):
        register(ep.name, loaded)
        return ""
    return "" if set(OPERATIONS) - before else \
        "the module registers no operation (extensions.register) on import"


def on_extension(s: Session, stream: int, env: Extension) -> None:
    """The handler of an EXTENSION envelope: run its operation, answer in kind."""
    operation = OPERATIONS.get(env.operation)
    if operation is None:
        # the names it has are not listed: a client of one tenant learns nothing of the
        # server's other operations
        raise ProtocolError(
            f"unknown private operation {env.operation!r}: this server does not serve it",
            ErrorCode.UNKNOWN_OPERATION, field="extension.operation", value=env.operation,
            rule="an operation the server registers (extensions.register, or the entry "
                 f"point group {GROUP})")
    if s.operations_in_flight >= MAX_IN_FLIGHT:
        raise ProtocolError(
            f"private operation {env.operation!r} not run: {MAX_IN_FLIGHT} private "
            "operations of this connection are awaiting their answer; send it again once "
            "one is answered", ErrorCode.SERVER_BUSY, field="extension.operation",
            value=env.operation,
            rule=f"at most {MAX_IN_FLIGHT} private operations in flight per connection")
    try:
        reply = operation(s, env.payload)
    except HurrayError:
        raise  # ProtocolError: its code; others INVALID_MESSAGE (the connection's rule)
    except BaseException as e:  # SystemExit, CancelledError...: the operation's, not ours
        log.exception("private operation %r failed", env.operation)
        raise _internal(env.operation, e) from None
    if inspect.isawaitable(reply):
        s.operations_in_flight += 1
        s.spawn(_answer_later(s, stream, env.operation, reply))
        return
    _answer(s, stream, env.operation, reply)


def _internal(name: str, e: BaseException) -> ProtocolError:
    return ProtocolError(f"private operation {name!r} failed: {type(e).__name__}: {e}",
                         ErrorCode.INTERNAL, field="extension.operation", value=name)


def _answer(s: Session, stream: int, name: str, reply: Reply) -> None:
    message = _message(s, stream, name, reply)
    if isinstance(reply, Handover):
        s.spawn(_hand_over(s, message, reply))
    else:
        s.send(message)


async def _hand_over(s: Session, message: bytes, reply: Handover) -> None:
    await s.send_with_fds(message, reply.fds)  # reply.keep held open until sent


def _message(s: Session, stream: int, name: str, reply: Reply) -> bytes:
    if isinstance(reply, Handover):
        if not s.can_pass_fds():
            raise _internal(name, TypeError("it passes descriptors to a client that is not "
                                            "on a Unix socket without TLS"))
        reply = reply.payload
    if not isinstance(reply, bytes | bytearray | memoryview):
        raise _internal(name, TypeError(f"it returned {type(reply).__name__}, not bytes"))
    message = frame(MessageType.EXTENSION, stream, Extension(name, bytes(reply)))
    most = s.hello.max_message_size if s.hello is not None else None
    if most is not None and len(message) - HEADER.size > most:
        raise ProtocolError(f"private operation {name!r}: its reply of "
                            f"{len(message) - HEADER.size} bytes exceeds the client's "
                            f"max_message_size {most}", ErrorCode.MESSAGE_TOO_LARGE,
                            field="extension.payload", value=len(message) - HEADER.size)
    return message


async def _answer_later(s: Session, stream: int, name: str, reply: Awaitable[Reply]) -> None:
    try:
        try:
            data = await reply
        except HurrayError:
            raise
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and _connection_closed():
                raise
            log.exception("private operation %r failed", name)
            raise _internal(name, e) from None
        if isinstance(data, Handover):
            await s.send_with_fds(_message(s, stream, name, data), data.fds)
        else:
            _answer(s, stream, name, data)
    except HurrayError as e:
        log.info("stream %d: %s", stream, e)
        s.fail(stream, code_of(e), str(e))
    finally:
        s.operations_in_flight -= 1


def _connection_closed() -> bool:
    """Whether the running task was cancelled from outside (``Session.spawn`` cancels it
    when its connection closes), rather than handed a CancelledError by the operation."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
