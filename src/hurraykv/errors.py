"""The HurrayError hierarchy: every rejection hurraykv makes is one of these.

A message names the field, where it sits (a byte offset in a descriptor, or an
index into a buffer), the value found and the rule it breaks, so that a user can
find the bad byte without a debugger.  The same facts are kept as attributes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class HurrayError(Exception):
    """Base class of every error hurraykv raises on bad input or misuse."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        offset: int | None = None,
        value: Any = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.offset = offset
        self.value = value
        self.rule = rule

    @classmethod
    def at(
        cls,
        field: str,
        offset: int | None,
        value: Any,
        rule: str,
        *,
        where: str = "byte",
    ) -> HurrayError:
        """Build an error with the house message: field, position, value found, rule."""
        place = "" if offset is None else f" at {where} {offset}"
        shown = f"{value} (0x{value:x})" if type(value) is int and value >= 0 else repr(value)
        return cls(
            f"{field}{place}: found {shown}; {rule}",
            field=field,
            offset=offset,
            value=value,
            rule=rule,
        )


class DescriptorError(HurrayError):
    """Framing of a descriptor: magic, version, lengths, flags, rank, truncation, sections."""


class ElementTypeError(HurrayError):
    """An element type tag that is invalid, reserved, unknown or unusable here."""


class LayoutError(HurrayError):
    """Layout fields and the structural invariants of a layout (block-paged included)."""


class HurrayBufferError(HurrayError):
    """Buffer table entries and buffer contents: sizes, alignment, devices, placement."""


# Deprecated alias: ``BufferError`` shadows Python's builtin of the same name (raised by
# memoryview and the buffer protocol), so ``except BufferError`` near hurraykv code could
# catch either.  It stays importable (``hk.BufferError``, ``hurraykv.errors.BufferError``)
# as the same class; new code names HurrayBufferError.
BufferError = HurrayBufferError


class QuantizationError(HurrayError):
    """Quantization section: scheme tags, payload fields, composition, parameter buffers."""


class SeqLensRequiredError(LayoutError):
    """Per-sequence token counts are not on the wire and cannot be derived (decision D6)."""


class PermissiveAccessError(HurrayError):
    """A descriptor decoded in permissive mode relaxed a rule, so its data must not be touched."""


class UnsupportedError(HurrayError):
    """Valid Hurray that this implementation does not handle (e.g. sub-byte pages, D11)."""


class SnapshotError(HurrayError):
    """A KV-cache snapshot whose members do not fit together (layers, roles, geometry)."""


class StreamError(HurrayError):
    """The streaming format: limits, truncation, torn composites."""


class ContainerError(HurrayError):
    """The .hrry file container: header, trailer, index, KV metadata, regions."""


class TransportError(HurrayError):
    """A connection that could not be made, broke, or timed out (the address is named)."""


class RemoteError(HurrayError):
    """The peer answered with an Hurray ERROR message: ``code`` and ``remote_message``."""

    def __init__(self, code: int, message: str, name: str | None = None) -> None:
        shown = name or f"0x{code:x}"
        super().__init__(f"peer error {shown} ({code}): {message}", field="error_code",
                         value=code, rule="the peer rejected the request")
        self.code = code
        self.remote_message = message


class StoreError(HurrayError):
    """A snapshot or page that is not in the Redis store, or a manifest that does not parse."""


class MissingDependencyError(HurrayError, ImportError):
    """An optional package a feature needs is not installed (the extra to install named)."""


def require(module: str, extra: str, feature: str) -> Any:
    """Import ``module`` for ``feature``, or say which hurraykv extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{feature} needs the {module.split('.')[0]} package, which is not installed: "
            f"pip install 'hurraykv[{extra}]'", field="dependency", value=module,
            rule=f"the [{extra}] extra") from None


class ConfigError(HurrayError, ValueError):
    """A setting that cannot be used as given: an option's value (an address, a URL of an
    unknown scheme), or a file or directory an option names that cannot be read or made.
    The command line exits 2 (usage) for it; the message names the option and the value.
    Also a ``ValueError``, which is what such code raised before."""


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean 'inspect'?"`` for the known name closest to a mistyped ``word``
    (difflib's ratio, at least 0.6), or ``""`` when none is close: for messages that
    refuse an unknown key, option or command."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(k) for k in known], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
