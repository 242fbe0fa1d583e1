"""Session fixtures for real Redis servers, shared by ``tests/`` and ``engine_tests/``
(each conftest imports them; the servers come from ``redis_servers.py``)."""

from __future__ import annotations

import pytest

from tests.redis_servers import cluster, single_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    with single_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url
