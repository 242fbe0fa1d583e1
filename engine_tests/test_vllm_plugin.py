"""The ``vllm.general_plugins`` entry point, as vLLM loads it (``vllm/plugins/
__init__.py``: ``load_general_plugins`` in every process): ``"kv_connector":
"HurrayConnector"`` resolves without ``kv_connector_module_path``, the module path still
resolves, and a second registration (vLLM may load plugins twice) is harmless.  The real
``vllm serve`` started by name alone is ``test_vllm_serve.py``'s quickstart test."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

from hurraykv.integrations import vllm_plugin
from hurraykv.integrations.vllm.connector import HurrayConnector


def test_the_installed_entry_point_names_the_connector_in_vllms_registry():
    assert "hurraykv" in {e.name for e in entry_points(group="vllm.general_plugins")}
    load_general_plugins()
    by_name = KVTransferConfig(kv_connector="HurrayConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(by_name) is HurrayConnector
    by_path = KVTransferConfig(kv_connector="HurrayConnector", kv_role="kv_both",
                               kv_connector_module_path="hurraykv.integrations.vllm")
    assert KVConnectorFactory.get_connector_class(by_path) is HurrayConnector
    vllm_plugin.register()  # again, as a second load would: no "already registered"
    assert KVConnectorFactory.get_connector_class(by_name) is HurrayConnector


def test_a_vllm_whose_registry_refuses_it_still_starts(monkeypatch, caplog):
    """vLLM runs plugins unguarded: one that raised would stop every vllm serve here."""
    def refuse(*args, **kwargs):
        raise AttributeError("a vLLM without register_connector")

    monkeypatch.delitem(KVConnectorFactory._registry, "HurrayConnector", raising=False)
    monkeypatch.setattr(KVConnectorFactory, "register_connector", refuse)
    vllm_plugin.register()
    assert "could not register HurrayConnector with vLLM (AttributeError: a vLLM without " \
           "register_connector)" in caplog.text
    assert '"kv_connector_module_path": "hurraykv.integrations.vllm"' in caplog.text
