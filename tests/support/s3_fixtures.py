"""Session fixtures for a real S3 server (SeaweedFS, ``s3_servers.py``), shared by
``tests/`` and ``engine_tests/``: started once, its credentials and endpoint set as the
standard AWS environment variables (what the ``s3://`` store reads, in this process and
the ones it starts), each test given a prefix of its own (``s3_url``)."""

from __future__ import annotations

import itertools
import os
import uuid

import pytest

from tests.support.s3_servers import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    CuttingProxy,
    SeaweedS3,
    seaweed,
)

BUCKET = "hurraykv-tests"
_prefixes = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's SeaweedFS, bucket ``BUCKET`` made, the AWS variables pointing at it
    (restored after the session)."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
             "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")
    before = {n: os.environ.get(n) for n in names}
    with seaweed(tmp_path_factory.mktemp("seaweed"), BUCKET) as server:
        for n in ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(n, None)
        os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                          AWS_ENDPOINT_URL=server.endpoint, AWS_REGION=REGION)
        try:
            yield server
        finally:
            for n, v in before.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v


@pytest.fixture(scope="session")
def own_server(s3_server, tmp_path_factory):
    """A second server, bucket ``killed``, that tests kill, stop and restart (each leaves
    it running), behind a proxy that cuts; one a session (its start costs seconds), and
    killed at the end (its data is the session's)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed-killed"))
    server.start("killed")
    proxy = CuttingProxy(server.ports["s3.port"])
    yield server, proxy
    proxy.close()
    server.kill()


def s3_prefix_url(server: SeaweedS3) -> str:
    """``s3://BUCKET/PREFIX`` of a prefix no other test uses (nothing stored there)."""
    return f"s3://{BUCKET}/t{next(_prefixes)}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_url(s3_server) -> str:
    return s3_prefix_url(s3_server)
