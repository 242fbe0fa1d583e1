"""What the ``s3://`` store does besides the contract (``TestS3Store`` in
``test_chunk_stores.py``): its URL and settings, its errors (every one a HurrayError, no
credential in any), multipart uploads, create-if-absent writes, and a real S3 server
(SeaweedFS) killed mid-PUT and mid-GET, then restarted."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.urls import open_store
from hurraykv.errors import ConfigError, HurrayError, TransportError
from hurraykv.io import checksums
from hurraykv.testing import CHUNK, keys, segment
from tests.support.s3_servers import SECRET_KEY, free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def big(pages: int, seed: int) -> hk.KVCacheSnapshot:
    """A segment of ``pages`` pages of 8 KiB (two layers' keys and values: 32 KiB a page)."""
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((pages, CHUNK, 8, 128)).astype(np.float16) for _ in range(2)]
    return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
        pools, [-p for p in pools], np.arange(pages), [0, pages], [pages * CHUNK]))


@pytest.mark.parametrize(("url", "why"), [
    ("s3://AKIA:topsecret@bucket/p", r"its userinfo 'AKIA:\*\*\*' is not read"),
    ("s3://Bucket/p", "not an S3 bucket name"),
    ("s3://bucket:9000/p", "no port: the server is the option endpoint"),
    ("s3://bu/p", "not an S3 bucket name"),
    ("s3://bucket/a/../b", "its prefix 'a/../b'"),
    ("s3://bucket/p?max_bytes=1", "max_bytes is a setting of its own"),
])
def test_a_url_that_names_no_bucket_is_refused_and_never_shows_a_password(url, why):
    with pytest.raises(ConfigError, match=why) as e:
        open_store(url)
    assert "topsecret" not in str(e.value) and "topsecret" not in str(e.value.value)


def test_an_endpoint_is_http_or_https_host_and_port():
    for bad in ("127.0.0.1:9000", "ftp://h", "http://u:p@h", "http://h/path"):
        with pytest.raises(ConfigError, match=r"option endpoint is .*http://HOST\[:PORT\]"):
            open_store("s3://bucket/p", endpoint=bad)


def test_importing_hurraykv_and_its_stores_needs_no_obstore():
    code = ("import sys, hurraykv, hurraykv.chunks as c; c.schemes(); "
            "assert 'obstore' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr


def test_an_unreachable_endpoint_is_a_transport_error_naming_the_store(s3_server):
    port, = free_ports(1)
    store = open_store("s3://bucket/p", endpoint=f"http://127.0.0.1:{port}", timeout=2)
    for call in (lambda: store.locate(keys(2)), lambda: store.put(keys(1), 0, segment(1, 0),
                                                                  {}),
                 lambda: store.get("0" * 32 + "-0"), store.catalog, store.connect):
        with pytest.raises(TransportError, match=rf"s3://bucket/p: .*127\.0\.0\.1:{port}"):
            call()
    store.close()


def test_wrong_credentials_are_refused_without_showing_them(s3_server, s3_url, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + SECRET_KEY)
    store = open_store(s3_url, timeout=5)
    with pytest.raises(TransportError, match=r"access denied .*AWS_SECRET_ACCESS_KEY") as e:
        store.put(keys(1), 0, segment(1, 0), {})
    assert SECRET_KEY not in str(e.value)
    store.close()


def test_a_large_segment_goes_up_in_parts_and_a_second_write_stores_nothing(s3_url):
    store = open_store(s3_url)
    store.MULTIPART, store.PART = 4 << 20, 5 << 20  # parts of 5 MiB (S3's least)
    k, snap = keys(192), big(192, 1)  # 6 MiB
    store.put(k, 0, snap, {})
    name = store.locate(k)[0]
    (s,) = store.catalog()
    assert s.name == name and "-" in s.version  # a multipart upload's ETag: "...-2"
    assert store.get_verified(name).equal(snap)
    small_k = keys(2)
    store.put(small_k, 0, segment(2, 3), {})
    before = {x.name: x.version for x in store.catalog()}
    store.put(small_k, 0, segment(2, 3), {})  # If-None-Match: the object stays as it was
    store.put(k, 0, snap, {})  # a HEAD finds it: no second upload
    assert {x.name: x.version for x in store.catalog()} == before
    store.close()


@pytest.mark.slow
def test_a_server_killed_mid_put_leaves_no_half_segment_and_serves_the_rest_again(own_server):
    server, proxy = own_server
    store = open_store("s3://killed/put", endpoint=proxy.endpoint, timeout=10)
    earlier = [(keys(2), segment(2, i)) for i in range(3)]
    for k, snap in earlier:
        store.put(k, 0, snap, {})
    k, snap = keys(64), big(64, 2)  # 2 MiB
    proxy.arm(upstream=True, after=1 << 20, cut=server.kill)  # half of it sent
    with pytest.raises(HurrayError):
        store.put(k, 0, snap, {})
    assert proxy.cut_done.wait(10)
    with pytest.raises(TransportError):  # down: an error, never a miss or a guess
        store.locate(k)
    server.start("killed")
    assert store.locate(k) == [None] * 64  # no alias was written
    name = f"{k[-1]}-0"
    if store.exists([name]) == [True]:  # the PUT was whole after all: then all of it
        assert store.get_verified(name).equal(snap)
    for ek, esnap in earlier:  # what was stored before the crash is served again
        assert store.get_verified(store.locate(ek)[0]).equal(esnap)
    store.close()


@pytest.mark.slow
def test_a_server_killed_mid_get_is_an_error_then_the_segment_is_served_again(own_server):
    server, proxy = own_server
    store = open_store("s3://killed/get", endpoint=proxy.endpoint, timeout=10)
    k, snap = keys(64), big(64, 3)
    store.put(k, 0, snap, {})
    name = store.locate(k)[0]
    proxy.arm(upstream=False, after=1 << 20, cut=server.kill)  # half of it received
    with pytest.raises(HurrayError):  # never a snapshot of half the bytes
        store.get_verified(name)
    assert proxy.cut_done.wait(10)
    server.start("killed")
    assert store.get_verified(store.locate(k)[0]).equal(snap)
    store.close()
