"""The cache identity every chunk key is seeded with (``context.identity_of``): engines
that compute other KV under one model name never share keys.  Built from the fields
``vllm/config/model.py``'s ``ModelConfig`` carries (``model``, ``dtype``, ``revision``,
``quantization``, ``hf_overrides``), no engine started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hurraykv.integrations.vllm.config import ConnectorConfig
from hurraykv.integrations.vllm.context import identity_of
from hurraykv.integrations.vllm.store_format import StoreFormat


def identity(**model) -> str:
    fields = {"model": "org/llama", "dtype": "torch.bfloat16", "revision": None,
              "quantization": None, "hf_overrides": {}} | model
    config = SimpleNamespace(model_config=SimpleNamespace(**fields),
                             cache_config=SimpleNamespace(cache_dtype="auto"),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return identity_of(config, None, ConnectorConfig.from_extra({"url": "file:///tmp/x"}), 32,
                     StoreFormat())


def test_a_plain_engine_keeps_its_identity():
    assert identity() == "model=org/llama;cache_dtype=bfloat16;chunk_size=32;tp_size=1"


@pytest.mark.parametrize("change", [{"revision": "v2"}, {"quantization": "awq"},
                                    {"quantization": "fp8"},
                                    {"hf_overrides": {"rope_scaling": {"factor": 4.0}}}])
def test_other_weights_under_one_name_are_another_identity(change):
    assert identity(**change) != identity()
    assert identity(**change) == identity(**change)  # and stable
