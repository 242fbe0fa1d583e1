"""A live store of each built-in chunk store class, for the tests that run against every
one (``tests/cli/test_cli_cache.py``, the connector's removal watch): which classes come
from the registry (``builtin``), how to start one of each lives here, and a built-in store
with no way to start it fails those tests, naming this module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hurraykv import chunks


def builtin() -> list[str]:
    """One scheme of each built-in store class (its first) that another process reaches
    by its URL alone, for ``parametrize``: not ``mem://``, whose pool is its process's
    (``tests/store/test_memory_store.py``)."""
    return [c.SCHEMES[0] for c in chunks.store_classes(plugins=False) if not c.IN_PROCESS]


@contextmanager
def live_url(scheme: str, tmp_path: Path, request: Any) -> Iterator[str]:
    """The URL of an empty store of ``scheme``, alive for the ``with`` block (``request``:
    the test's, for the session's Redis and S3 servers)."""
    if scheme == "file":
        yield (tmp_path / "kv").as_uri()
    elif scheme == "hurray":
        from hurraykv.net.server import KVServer

        with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
            yield f"hurray://{st.address}"
    elif scheme == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushall()
        yield url
    elif scheme == "s3":  # a prefix of its own on the session's SeaweedFS (s3_fixtures)
        from tests.support.s3_fixtures import s3_prefix_url

        yield s3_prefix_url(request.getfixturevalue("s3_server"))
    else:
        raise AssertionError(f"no way to start a {scheme}:// store for the tests: add one "
                             "to tests/support/store_urls.py")
