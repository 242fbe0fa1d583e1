"""Every built-in chunk store against the one contract (``hurraykv.testing.ChunkStoreTests``;
each test class names the scheme it opens, ``SCHEME``), plus what the registry itself
promises: the URL forms in messages, the config and the docs are the registered ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hurraykv import chunks
from hurraykv.chunks import registry  # noqa: F401 - chunks.registry below
from hurraykv.chunks.registry import schemes, store_class, url_forms
from hurraykv.chunks.settings import Option
from hurraykv.chunks.urls import open_store
from hurraykv.errors import ConfigError, HurrayError
from hurraykv.net.server import KVServer
from hurraykv.testing import ChunkStoreTests, segment
from tests.support.redis_servers import free_port, redis_server_binary, start_redis

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_BYTES = 16 * 4 * 2 * 8 * 2 * 4  # pages x tokens x heads x dim x fp16 x pools


class TestFileStore(ChunkStoreTests):
    SCHEME = 'file'
    @pytest.fixture
    def make(self, tmp_path):
        return lambda: open_store((tmp_path / "kv").as_uri())

    @pytest.fixture
    def capped(self, tmp_path):
        # twelve segments of the contract's, as files (headers and alignment included)
        probe = open_store((tmp_path / "probe").as_uri())
        probe.put(["0" * 32], 0, segment(16, 0), {})
        size = (tmp_path / "probe" / f"{'0' * 32}-0.hrry").stat().st_size
        return open_store((tmp_path / "capped").as_uri(), max_bytes=12 * size)


class TestServerStore(ChunkStoreTests):
    SCHEME = 'hurray'
    @pytest.fixture
    def make(self):
        with KVServer(listen="127.0.0.1:0").run_in_thread() as st:
            yield lambda: open_store(f"hurray://{st.address}")

    @pytest.fixture
    def capped(self):
        with KVServer(listen="127.0.0.1:0").run_in_thread() as st:  # an object's bytes
            probe = open_store(f"hurray://{st.address}")
            probe.put(["0" * 32], 0, segment(16, 0), {})
            (_, size), = probe._call(lambda c: c.list_keys(probe.prefix))
            probe.close()
        with KVServer(listen="127.0.0.1:0", memory_budget=12 * size).run_in_thread() as st:
            s = open_store(f"hurray://{st.address}")
            yield s
            s.close()


class TestRedisStore(ChunkStoreTests):
    SCHEME = 'redis'
    KEEPS_RECENT = False  # allkeys-lru samples keys, and aliases are keys too (H91)
    PINS = False  # Redis evicts by its own policy: a pin is refused, saying so

    def test_a_pin_is_refused_saying_why(self, store):
        k = ["1" * 32]
        store.put(k, 0, segment(1, 9), {})
        with pytest.raises(HurrayError, match="maxmemory-policy") as e:
            store.retain(store.locate(k), pin=True, ttl_s=None)
        assert e.value.field == "pin"

    @pytest.fixture
    def make(self, redis_url):
        return lambda: open_store(redis_url)

    @pytest.fixture
    def capped(self, tmp_path):
        proc = start_redis(redis_server_binary(), tmp_path, port := free_port(),
                           "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
        try:
            s = open_store(f"redis://127.0.0.1:{port}")
            yield s
            s.close()
        finally:
            proc.terminate()
            proc.wait(10)


class TestMemoryStore(ChunkStoreTests):
    SCHEME = 'mem'

    @pytest.fixture
    def pool(self, request):
        """A pool of this test's own: every store opened on mem://NAME shares it."""
        return f"t{abs(hash(request.node.nodeid)):x}"

    @pytest.fixture
    def make(self, pool):
        return lambda: open_store(f"mem://{pool}", max_bytes=1 << 30)

    @pytest.fixture
    def capped(self, pool):
        from hurraykv.chunks.memory import copied

        size = copied(segment(16, 0).with_info(metadata={}))[1]  # the members' bytes
        return open_store(f"mem://{pool}-capped", max_bytes=12 * size)


class TestRedisClusterStore(ChunkStoreTests):
    SCHEME = 'redis+cluster'
    PINS = False
    @pytest.fixture
    def make(self, redis_cluster_url):
        return lambda: open_store(redis_cluster_url)

    @pytest.fixture
    def capped(self):
        return None  # each node's maxmemory, as TestRedisStore's


class TestS3Store(ChunkStoreTests):
    SCHEME = 's3'

    @pytest.fixture
    def make(self, s3_url):
        return lambda: open_store(s3_url)

    @pytest.fixture
    def capped(self, s3_server, s3_url):
        probe = open_store(s3_url)  # an object's bytes: the .hrry file's
        probe.put(["0" * 32], 0, segment(16, 0), {})
        size = probe.catalog()[0].nbytes
        probe.close()
        s = open_store(f"{s3_url}-capped", max_bytes=12 * size)
        yield s
        s.close()


def test_every_builtin_store_is_registered_with_a_form_and_runs_the_contract():
    builtin = chunks.store_classes(plugins=False)
    assert {c.__module__ for c in builtin} == {f"hurraykv.chunks.{m}"
                                               for m in chunks.registry.BUILTIN}
    for cls in chunks.store_classes():
        assert cls.SCHEMES and cls.FORM
        assert all(store_class(s) is cls for s in cls.SCHEMES)
    assert sorted(schemes()) == sorted(s for c in chunks.store_classes() for s in c.SCHEMES)
    tested = {store_class(c.SCHEME) for c in globals().values()
              if isinstance(c, type) and issubclass(c, ChunkStoreTests) and c.__module__
              == __name__}
    assert set(builtin) <= tested, "a built-in store whose test class is missing here"


@pytest.mark.parametrize(("url", "options", "why"), [
    ("ftp://x/y", {}, None),  # None: "scheme 'ftp' is not one of" the registered
    ("file://host/x", {}, "local directory"),
    ("hurray://", {}, "HOST:PORT"),
    ("hurray://h:notaport", {}, r"HOST:PORT \(hurray://HOST:PORT\), not 'h:notaport'"),
    ("hurray://:5", {}, "HOST:PORT"),
    ("file://", {}, "absolute directory"),
    ("file:relative/dir", {}, "absolute directory"),
    ("redis://127.0.0.1:1", {"max_bytes": 10}, r"option 'max_bytes' is not one a redis:// "
                                               r"store takes \(its options: none\); "
                                               r"file:///DIR, mem://\[NAME\] and "
                                               r"s3://BUCKET/PREFIX take it"),
    ("file:///tmp/x", {"tls_ca": "ca.pem"}, r"hurray://HOST:PORT takes it"),
    ("file:///tmp/x", {"max_byte": 1}, r"did you mean 'max_bytes'\?"),
])
def test_a_bad_url_is_refused_with_the_registered_forms(url, options, why):
    why = why or rf"scheme 'ftp' is not one of {re.escape(', '.join(schemes()))};"
    with pytest.raises(HurrayError, match=why) as e:
        open_store(url, **options)
    assert url_forms() in str(e.value)


def test_open_store_reads_options_by_their_kind_and_checks_them_first(tmp_path):
    """``open_store`` reads a text option as the connector and ``hurraykv cache`` do
    (``"64K"`` for a size), refuses one that is not of its kind naming it, and runs the
    store class's ``check_options`` before opening (a TLS file that is not there)."""
    store = open_store(tmp_path.as_uri(), max_bytes="64K")
    assert store.capacity.max_bytes == 64 * 1024
    with pytest.raises(HurrayError, match=r"option max_bytes is 'lots'; it is a positive "
                                          r"byte count or a size like 64G"):
        open_store(tmp_path.as_uri(), max_bytes="lots")
    with pytest.raises(HurrayError, match=r"option tls_ca.*nowhere\.pem"):
        open_store("hurray://127.0.0.1:1", tls_ca=str(tmp_path / "nowhere.pem"))


@pytest.mark.parametrize(("kind", "text"), [
    ("int", "\uff11\uff12"), ("int", "\u0661\u0662"), ("int", "1_000"), ("float", "\uff12.5"),
    ("float", "1_0.5"), ("size", "\uff16\uff14G"), ("size", "\u0664K"), ("size", "1_024"),
])
def test_a_numeric_option_is_ascii_digits_only(kind, text):
    """Item 13 (issue 46): int() and float() read any script's digits ('\uff11\uff12' is 12)
    and '1_000'; an option's number or size is ASCII digits, else a ConfigError naming
    the option, the text and the rule (``open_store``'s and ``hurraykv cache``'s)."""
    option = Option("n", kind)
    with pytest.raises(ConfigError, match=rf"option n is '{text}'; it is .*ASCII digits") as e:
        option.parse(text, "option n")
    assert (e.value.field, e.value.value) == ("n", text)
    assert option.parse(" 12 ", "option n") == {"int": 12, "float": 12.0, "size": 12}[kind]


def test_the_docs_and_the_module_docstring_name_every_form():
    text = (ROOT / "docs" / "vllm.md").read_text()
    url_row = next(line for line in text.splitlines() if line.startswith("| `url` |"))
    for cls in chunks.store_classes(plugins=False):  # the docs are the package's stores'
        assert all(f in url_row or f.replace("HOST:PORT", "...") in url_row
                   for f in cls.FORM.split(" or ")), cls.FORM
        assert cls.__name__ in chunks.__doc__


def test_a_segment_reads_back_through_every_scheme_alias(tmp_path):
    # the same class serves each of its schemes: file:// and file://localhost
    for url in ((tmp_path / "a").as_uri(), f"file://localhost{tmp_path / 'b'}"):
        s = open_store(url)
        assert type(s).__name__ == "FileChunks"
        assert s.locate([]) == []
        s.put(["a" * 32], 0, segment(1, 0), {})
        assert s.get_verified(s.locate(["a" * 32])[0]).equal(segment(1, 0))


def test_a_store_class_naming_schemes_must_say_how_it_opens():
    from hurraykv.chunks.registry import ChunkStore

    with pytest.raises(TypeError, match=r"defines no classmethod open"):
        type("NoOpen", (ChunkStore,), {"SCHEMES": ("noopen",), "FORM": "noopen://X"})
    assert store_class("noopen") is None


def test_a_read_buffer_is_never_reused_while_a_snapshot_over_it_lives(tmp_path):
    """Issue 30: a segment of 4 MiB or more is read into a mapped buffer, and NumPy bases
    every view of it on the mapping, not on the buffer: the pool took the buffer for free
    while the loads of one step still read the segment in it, and the next read
    overwrote it (the loads' checksums caught it, as damage of valid segments)."""
    import numpy as np

    import hurraykv as hk
    from hurraykv.io import checksums
    from hurraykv.testing import CHUNK, keys

    def big(seed: int) -> hk.KVCacheSnapshot:  # 8 MiB: 2 layers x K, V x 2 MiB each
        rng = np.random.default_rng(seed)
        pools = [rng.standard_normal((256, CHUNK, 8, 128)).astype(np.float16)
                 for _ in range(2)]
        return checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
            pools, [-p for p in pools], np.arange(256), [0, 256], [256 * CHUNK]))

    store = open_store((tmp_path / "kv").as_uri())
    names = []
    for seed in (1, 2, 3):
        ks = keys(256)
        store.put(ks, 0, big(seed), {})
        names.append(store.locate(ks)[0])
    reader = open_store((tmp_path / "kv").as_uri())
    held = [reader.get_verified(name) for name in names]  # all alive at once
    for snap, seed in zip(held, (1, 2, 3), strict=True):
        assert snap.equal(big(seed)), f"segment {seed} was overwritten by a later read"
    del held, snap
    reader.get_verified(names[0])
    reader.get_verified(names[1])
    assert len(reader._buffers._free) == 3  # freed buffers are reused, not added


def test_the_old_import_paths_give_the_same_objects_for_one_release():
    """Issue 48 moved the stores to hurraykv.chunks; CHANGELOG promises the old paths for
    one release: the same objects, so a plugin subclassing the old ChunkStore registers."""
    import hurraykv.chunks.file
    import hurraykv.chunks.redis
    import hurraykv.chunks.server
    from hurraykv.integrations import chunks as old
    from hurraykv.integrations import file_store, redis_store, server_store

    assert old.ChunkStore is chunks.ChunkStore and old.open_store is chunks.open_store
    assert all(getattr(old, n) is getattr(chunks, n) for n in chunks.__all__)
    assert file_store.FileChunks is hurraykv.chunks.file.FileChunks
    assert redis_store.RedisChunks is hurraykv.chunks.redis.RedisChunks
    assert server_store.ServerChunks is hurraykv.chunks.server.ServerChunks
