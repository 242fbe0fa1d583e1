"""vLLM's HurrayConnector, as a package split by role (see ``connector.py``).

``HurrayConnector`` and ``HurrayConnectorMetadata`` are imported on first use, so that
``config``, ``scheduler`` and ``request_keys`` import without vLLM or torch (the main test
suite tests them without an engine); vLLM finds the class with ``getattr`` on this
module, by its registered name (``vllm_plugin.py``) or by
``kv_connector_module_path: hurraykv.integrations.vllm``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HurrayConnector", "HurrayConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
