"""Moved to ``hurraykv.chunks`` (issue 48): this path keeps working for one release
(``CHANGELOG.md``) and re-exports the same objects, so a store class subclassing
``hurraykv.integrations.chunks.ChunkStore`` still registers.  Import from
``hurraykv.chunks`` instead."""

from ..chunks import *  # noqa: F403 - the old path's names, the same objects
from ..chunks import __all__  # noqa: F401
from ..chunks.keys import (  # noqa: F401 - named by the old module, used by plugins
    ALIAS_LINE,
    DIGEST,
    KEY,
    SEED,
    SEGMENT_NAME,
    check_name,
    segment_name,
)
from ..chunks.registry import BUILTIN, RESERVED  # noqa: F401
from ..chunks.settings import KINDS  # noqa: F401
from ..chunks.suffixed import Suffixed, suffixed  # noqa: F401
from ..chunks.urls import check_url  # noqa: F401
