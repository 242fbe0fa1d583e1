"""A plugin module that defines a scheme but forgets ``@register``: hurraykv says so."""

from dataclasses import dataclass
from typing import ClassVar

from hurraykv.wire.quant_schemes import PerBlockAffine


@dataclass(frozen=True)
class Forgotten(PerBlockAffine):
    TAG: ClassVar[int] = 0xF4
    NAME: ClassVar[str] = "forgotten_slot"
