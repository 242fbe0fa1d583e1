"""A quantization scheme from outside hurraykv, registered through the entry point
group ``hurraykv.quant_schemes`` (this directory's dist-info names the class): one scale
per page slot like per_block_affine, under a private tag and a name of its own."""

from dataclasses import dataclass
from typing import ClassVar

from hurraykv.wire.quant_schemes import PerBlockAffine


@dataclass(frozen=True)
class ToySlotScheme(PerBlockAffine):
    TAG: ClassVar[int] = 0xF3
    NAME: ClassVar[str] = "toy_per_slot"
