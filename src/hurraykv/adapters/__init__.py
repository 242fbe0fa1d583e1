"""Floor 5: engine layouts to and from KVCacheSnapshot (PyTorch is imported only here)."""

from ..errors import require

require("torch", "adapters", "hurraykv.adapters")
