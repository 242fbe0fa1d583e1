"""The quantization scheme registry and the base class every scheme subclasses.

A scheme is one frozen dataclass subclassing ``QuantScheme`` and decorated with
``@register``; everything that enumerates schemes asks the registry (``scheme_class``,
``scheme_by_name``, ``schemes``, ``RegistryView``) or a scheme's properties.  The
registry fills itself on the first lookup: the five schemes the spec assigns
(``BUILTIN``, ``quant_schemes.py``), then every module or class named in the entry point
group ``hurraykv.quant_schemes`` of an installed distribution, so a scheme from outside
the package needs no edit inside it.  A plugin that cannot be imported or collides with
a scheme already registered is skipped with a warning naming it; the built-ins always
stand.  The recipe: docs/architecture.md, "Extending hurraykv".
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any, ClassVar

import numpy as np

from .. import plugins
from ..errors import QuantizationError
from .cursor import Cursor
from .dtypes import BY_NAME

NO_BUFFER = 0xFFFFFFFF
SYMMETRIC = 0x0001
SCALE_TYPE_NAMES = {0x01: "float16", 0x02: "bfloat16", 0x03: "float32"}
SCALE_WIDTHS = {t: BY_NAME[n].itemsize for t, n in SCALE_TYPE_NAMES.items()}
INT_STORAGE = ("int8", "uint8", "int4", "uint4", "int2", "uint2")
_HEAD = struct.Struct("<BBH")

BUILTIN = "hurraykv.wire.quant_schemes"  # the spec's schemes, registered on import
ENTRY_POINTS = "hurraykv.quant_schemes"  # plugins: a module (registering) or a class

_REGISTRY: dict[int, type[QuantScheme]] = {}
_LISTENERS: list[Callable[[], object]] = []
_loaded = False


class SchemePluginWarning(UserWarning):
    """An entry point of ``hurraykv.quant_schemes`` that was skipped, and why."""


class SchemeRegistrationError(QuantizationError, ValueError):
    """A scheme class ``register`` refuses: its ``TAG`` invalid, reserved or another
    scheme's, or its ``NAME`` another scheme's (``field`` says which, ``value`` what it
    holds).  Also a ``ValueError``, what ``register`` raised before."""


def _load() -> None:
    """Register the built-in schemes, then the plugins, once (on the first lookup)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module(BUILTIN)
    plugins.load(ENTRY_POINTS, _load_one, SchemePluginWarning, set())


def _load_one(ep: EntryPoint) -> str:
    """Why ``ep`` registers no scheme ("" when it does)."""
    before = set(_REGISTRY.values())
    found = ep.load()
    if isinstance(found, type):
        if scheme_class(found.TAG) is not found:
            register(found)
        return ""
    return "" if set(_REGISTRY.values()) - before else (
        "the module registers no scheme on import (a QuantScheme class decorated with "
        "@register, or the class named in the entry point)")


def on_registry_change(fn: Callable[[], object]) -> None:
    """Call ``fn`` whenever a scheme is registered or unregistered (the descriptor
    decoder's cache of verdicts)."""
    _LISTENERS.append(fn)


def _changed() -> None:
    for fn in _LISTENERS:
        fn()


def _assignable(tag: int) -> bool:
    """Tags a scheme may take: 0x01-0x5F (spec-assigned and future) and 0xF0-0xFE
    (private); 0x00/0xFF are invalid and 0x60-0xEF reserved."""
    return 0x01 <= tag <= 0x5F or 0xF0 <= tag <= 0xFE


def register(cls: type[QuantScheme]) -> type[QuantScheme]:
    """Class decorator: make ``cls`` the scheme of its ``TAG`` for every table, the
    decoder, the validation and the reports.  A tag that is invalid, reserved or another
    scheme's, or a name another scheme has, is a ``SchemeRegistrationError`` naming the
    field (``TAG``, ``NAME``); a class without its codec a ``TypeError``."""
    if cls.__module__ != BUILTIN:
        _load()  # the built-ins and plugins first: a collision is this class's
    if not _assignable(cls.TAG):
        rule = "a scheme takes 0x01-0x5F (assigned by the spec) or 0xF0-0xFE (private)"
        raise SchemeRegistrationError(
            f"{cls.NAME}: scheme tag 0x{cls.TAG:02x} is invalid or reserved; {rule}",
            field="TAG", value=cls.TAG, rule=rule)
    missing = [m for m in ("decode_body", "encode_body") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"scheme {cls.__name__} defines no {' or '.join(missing)}: a "
                        "registered scheme reads and writes its own payload")
    for other in _REGISTRY.values():
        if other.TAG == cls.TAG or other.NAME == cls.NAME:
            field, value = ("TAG", cls.TAG) if other.TAG == cls.TAG else ("NAME", cls.NAME)
            what = f"tag 0x{cls.TAG:02x}" if field == "TAG" else f"name {cls.NAME!r}"
            rule = "tags and names are one scheme's each"
            raise SchemeRegistrationError(
                f"{cls.__module__}.{cls.__qualname__} ({cls.NAME}, 0x{cls.TAG:02x}) takes "
                f"the {what} of {other.__module__}.{other.__qualname__} ({other.NAME}, "
                f"0x{other.TAG:02x}); {rule}", field=field, value=value, rule=rule)
    cls.STORAGE_TAGS = frozenset(BY_NAME[n].tag for n in cls.STORAGE)
    _REGISTRY[cls.TAG] = cls
    _changed()
    return cls


def unregister(cls: type[QuantScheme]) -> None:
    if _REGISTRY.get(cls.TAG) is cls:
        del _REGISTRY[cls.TAG]
        _changed()


def scheme_class(tag: int) -> type[QuantScheme] | None:
    _load()
    return _REGISTRY.get(tag)


def scheme_by_name(name: str) -> type[QuantScheme] | None:
    _load()
    found = [c for c in _REGISTRY.values() if c.NAME == name]  # noqa: SIM300
    return found[0] if found else None


def schemes() -> tuple[type[QuantScheme], ...]:
    """The registered scheme classes, by tag."""
    _load()
    return tuple(_REGISTRY[t] for t in sorted(_REGISTRY))


class RegistryView(Mapping):
    """A read-only table computed from the registry on every access, so a scheme
    registered later appears in it too."""

    def __init__(self, value: Callable[[type[QuantScheme]], Any],
                 key: Callable[[type[QuantScheme]], Any] | None = None,
                 where: Callable[[type[QuantScheme]], bool] | None = None) -> None:
        """``{key(c): value(c)}`` of every scheme class ``c`` where ``where(c)``; by
        default keyed by ``TAG``, of every scheme."""
        self._value = value
        self._key = key or (lambda c: c.TAG)
        self._where = where or (lambda c: True)

    def _table(self) -> dict:
        return {self._key(c): self._value(c) for c in schemes() if self._where(c)}

    def __getitem__(self, k: Any) -> Any:
        return self._table()[k]

    def __iter__(self) -> Iterator:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


def storage_range(type_name: str) -> tuple[int, int]:
    et = BY_NAME[type_name]
    if et.is_signed:
        return -(1 << (et.bits - 1)), (1 << (et.bits - 1)) - 1
    return 0, (1 << et.bits) - 1


def farthest_code(qmin: int, qmax: int, zero_points: Any = 0) -> Any:
    """How many steps the code of ``[qmin, qmax]`` farthest from each zero-point (an int
    or an int array) lies from it: what a scale multiplies at the edge of its range."""
    zp = np.asarray(zero_points, np.int64)
    return np.maximum(qmax - zp, zp - qmin)


def decodes_finitely(scales: Any, steps: Any) -> Any:
    """True where ``scale * steps`` is finite in float32, the arithmetic of dequantizing
    (H74): False for a scale whose farthest code would decode to Inf, and for a scale
    that is not finite itself."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.isfinite(np.asarray(scales, np.float32) * np.asarray(steps, np.float32))


def as_written(scale: Any) -> float:
    """A float32 scale as its shortest repr reads (3e+38, not its float64 widening
    3.0000000054977558e+38): for messages."""
    return float(str(np.float32(scale)))


def overflow_rule(steps: int, storage: str) -> str:
    """The rule a refused scale breaks, for messages (quantizing, loading, decoding)."""
    return (f"the scale times the {steps} steps from the zero-point to the farthest "
            f"{storage} code must stay within float32 (at most "
            f"{float(np.finfo(np.float32).max):g}); a larger scale decodes to Inf")


def is_pow2(v: int) -> bool:
    return v > 0 and not v & (v - 1)


def product(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def check_param_sizes(q: QuantScheme, handles: tuple, count: int, scale_width: int,
                      cur: Cursor) -> None:
    """Scale (and zero-point) buffers hold exactly ``count`` entries; a shared entry
    holds ``[scales | zero_points]``."""
    zp = getattr(q, "zero_point_buffer", None)
    want = {q.scale_buffer: count * scale_width}  # type: ignore[attr-defined]
    if zp is not None:
        want[zp] = want.get(zp, 0) + count * 4
    for i, nbytes in want.items():
        got = handles[i].byte_size
        if got != nbytes:
            what = "scales and zero-points" if zp == q.scale_buffer else (  # type: ignore
                "zero-points" if i == zp else "scales")
            raise QuantizationError.at(
                f"buffers[{i}].byte_size", (cur.at("buffer_count") or 0) + 1 + 16 * i, got,
                f"{scheme_name(q.TAG)} {what} take exactly {nbytes} bytes "
                f"({count} entries)")


class QuantScheme:
    """What every scheme has; subclasses are frozen dataclasses ending in ``padding``.
    A registered scheme also defines its payload codec (``register`` checks):
    ``decode_body(cls, cur, start, flags)``, a classmethod reading the fields after the
    4-byte header (``LENGTH - 4`` bytes, their byte rules checked; ``start`` is the
    offset of the scheme tag), and ``encode_body(self) -> bytes``."""

    TAG: ClassVar[int]
    NAME: ClassVar[str]
    LENGTH: ClassVar[int] = 4
    FLAGS: ClassVar[int] = 0
    STORAGE: ClassVar[tuple[str, ...]] = ()
    STORAGE_TAGS: ClassVar[frozenset[int]] = frozenset()  # set by register()
    SCALE_TYPES: ClassVar[tuple[int, ...]] = ()
    GRANULARITY: ClassVar[str | None] = None
    AFFINE: ClassVar[bool] = False
    BLOCK_PAGED: ClassVar[bool] = False

    padding: bytes
    zero_point_buffer: int | None = None  # a dataclass field where a scheme has one

    # -- codec
    def encode(self) -> bytes:
        return (_HEAD.pack(self.TAG, 1, self.flags) + self.encode_body()  # type: ignore[attr-defined]
                + self.padding)

    # -- properties
    @property
    def flags(self) -> int:
        return 0

    @property
    def buffers(self) -> tuple[int, ...]:
        """Indices of the parameter buffers the section names."""
        return ()

    @property
    def per_slot(self) -> bool:
        """One parameter per page slot: parameters travel with their page (D4)."""
        return self.GRANULARITY == "slot"

    @property
    def scale_dtype(self) -> str:
        """Element type of a stored scale."""
        return "float32"

    @property
    def scale_width(self) -> int:
        """Bytes of one stored scale."""
        return BY_NAME[self.scale_dtype].itemsize

    def param_count(self, shape: tuple[int, ...]) -> int:
        """Parameter entries a tensor of ``shape`` needs (outside block-paged slots)."""
        return 0

    # -- context rules
    def check_in_context(self, desc: Any, cur: Cursor, *, paged: bool) -> None:
        type_tag: int = desc.type_tag
        if type_tag not in self.STORAGE_TAGS:
            raise QuantizationError.at(
                "type_tag", 14, type_tag,
                f"{self.NAME} storage MUST be one of {', '.join(self.STORAGE)}")

    def check_block_paged(self, page_size: int, cur: Cursor) -> None:
        """Rules of this scheme on a block-paged tensor (only if ``BLOCK_PAGED``)."""


@dataclass(frozen=True)
class RawQuantization(QuantScheme):
    """An unknown or private scheme, carried verbatim by a permissive reader (never
    registered)."""

    scheme_tag: int
    payload: bytes  # the whole section, header included

    @property
    def TAG(self) -> int:  # type: ignore[override]
        return self.scheme_tag

    @property
    def NAME(self) -> str:  # type: ignore[override]
        return scheme_name(self.scheme_tag)

    def encode(self) -> bytes:
        return self.payload

    def check_in_context(self, desc: Any, cur: Cursor, *, paged: bool) -> None:
        return


def scheme_name(tag: int) -> str:
    cls = scheme_class(tag)
    if cls is not None:
        return cls.NAME
    return f"private_0x{tag:02x}" if 0xF0 <= tag <= 0xFE else f"0x{tag:02x}"


__all__ = [
    "BUILTIN",
    "ENTRY_POINTS",
    "INT_STORAGE",
    "NO_BUFFER",
    "SCALE_TYPE_NAMES",
    "SCALE_WIDTHS",
    "SYMMETRIC",
    "QuantScheme",
    "RawQuantization",
    "RegistryView",
    "SchemePluginWarning",
    "SchemeRegistrationError",
    "as_written",
    "check_param_sizes",
    "decodes_finitely",
    "farthest_code",
    "is_pow2",
    "on_registry_change",
    "overflow_rule",
    "product",
    "register",
    "scheme_by_name",
    "scheme_class",
    "scheme_name",
    "schemes",
    "storage_range",
    "unregister",
]
