"""The shape of ``src/hurraykv/net`` (issue 34 item 2): its imports run one way, server
-> connection -> handlers -> admin/puts/pulls/extensions -> session, so a handler sees a
``Session`` and never the connection, and neither the connection nor the metrics see
the server (no circle, no private reach: ``tests/docs/test_structure.py``)."""

from __future__ import annotations

from tests.support.structure import SRC, imports


def test_handlers_see_a_session_and_the_connection_no_server():
    graph = {name.removeprefix("hurraykv.net."): {m.removeprefix("hurraykv.net.")
                                                  for m in found}
             for name, found in imports(SRC).items() if name.startswith("hurraykv.net.")}
    for module in ("handlers", "admin", "puts", "pulls", "extensions"):
        assert "connection" not in graph[module], module
    assert "server" not in graph["connection"] and "server" not in graph["metrics"]
    net = {m for m in graph}
    assert graph["session"] & net <= {"config", "counts", "keystore", "memory", "messages"}
