"""Session fixtures for real Redis servers, shared by ``tests/`` and ``engine_tests/``
(each conftest imports them; the servers come from ``redis_servers.py``)."""

from __future__ import annotations

import pytest

from tests.support.redis_servers import cluster, single_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    with single_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url


def emptied_url(request) -> str:
    """The single server's or the cluster's URL (``request.param``: "single" or "cluster"),
    every key removed first."""
    from hurraykv.store import PageStore

    url = request.getfixturevalue("redis_url" if request.param == "single"
                                  else "redis_cluster_url")
    s = PageStore.from_url(url)
    s.client.flushall() if request.param == "single" else s.client.flushall(
        target_nodes=s.client.PRIMARIES)
    s.client.close()
    return url
