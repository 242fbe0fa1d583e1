"""vLLM's ``vllm.general_plugins`` entry point: names ``HurrayConnector`` in vLLM's
connector registry, as vLLM's own connectors are named, so that

    --kv-transfer-config '{"kv_connector": "HurrayConnector", "kv_role": "kv_both", ...}'

is enough.  vLLM calls ``register`` in every process it starts (the API server, the
engine core, each worker), and may call it more than once in one, so a second call is a
no-op.  Nothing here imports torch or the connector: the registry loads
``hurraykv.integrations.vllm`` only when a config names the connector.  A config that
also gives ``kv_connector_module_path: hurraykv.integrations.vllm`` keeps working: vLLM
then imports that module itself and never looks at the registry.
"""

from __future__ import annotations

import logging

NAME = "HurrayConnector"
MODULE = "hurraykv.integrations.vllm"


def register() -> None:
    # vLLM calls plugins without a guard: one that raises stops every `vllm serve` of this
    # environment, those that never name the connector included (a vLLM that moved the
    # factory or its registry).  The module path still works then.
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        # vLLM's registry refuses a name twice; another package may also have taken ours
        if NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except Exception as e:
        logging.getLogger("hurraykv").warning(
            "hurraykv could not register %s with vLLM (%s: %s); name it with "
            "\"kv_connector_module_path\": \"%s\"", NAME, type(e).__name__, e, MODULE)
