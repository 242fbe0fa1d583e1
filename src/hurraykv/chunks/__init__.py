"""KV chunks by content: the keys and the stores the engine connectors share.

A chunk is ``chunk_size`` consecutive tokens of one sequence (whole engine blocks).  Its
key chains a 128-bit BLAKE2b digest over all tokens from the start of the sequence to the
chunk's end, seeded with the cache's identity (model, dtype, geometry, chunk size)::

    h_0 = BLAKE2b-128("hurraykv-chunks-v1" | identity)
    h_k = BLAKE2b-128(h_(k-1) | tokens of chunk k as int64 little-endian)

so two requests that share their first N tokens share the keys of their first
``N // chunk_size`` chunks, and chunks of another model or dtype never match.

Chunks are stored in *segments*: one KVCacheSnapshot of one sequence holding a run of
consecutive chunks (every layer's key and value pages), named ``LASTKEY-FIRST`` after the
key of its last chunk and the index of its first, with every chunk key of the run made an
alias of it.  A request's new chunks cost one object however many there are, and a later
request sharing any whole-chunk prefix still finds each chunk by its own key.

Stores, one class per URL scheme, registered by the schemes it declares (``SCHEMES``):
``file.FileChunks`` (``file:///DIR``: ``DIR/NAME.hrry``, each a .hrry snapshot that
``hurraykv inspect`` and ``hk.load_snapshot`` read; the aliases are lines of
``DIR/aliases.log``), ``server.ServerChunks`` (``hurray://HOST:PORT``: a ``hurraykv
serve``; aliases with its LINK and LOCATE messages), ``redis.RedisChunks``
(``redis://HOST:PORT``, ``rediss://``, ``redis+cluster://HOST:PORT``: the PageStore,
identical pages of different segments stored once; aliases as small keys),
``memory.MemoryChunks`` (``mem://[NAME]``: this process's memory, under a required
``max_bytes``), ``s3.S3Chunks`` (``s3://BUCKET/PREFIX``: an S3 bucket through
``obstore``, each segment a ``.hrry`` object, aliases as small objects).  A new backend
is one ``ChunkStore`` subclass naming its schemes and the settings it takes besides its
URL (``OPTIONS``: each an ``Option`` of a kind the connector's config parses), plus a test
class that inherits the contract (``hurraykv.testing.ChunkStoreTests``); ``open_store``,
its error messages and the connector's config check list what is registered, and refuse a
part of a URL (userinfo, path, query, fragment) that its class does not read
(``URL_PARTS``), so that no setting written there is dropped without a word.

A store from outside the package registers through the entry point group
``hurraykv.chunk_stores`` (``toy = my_package.toy_store`` or ``...:ToyChunks``: a module
whose ``ChunkStore`` subclasses register as they are defined, or one such class).  The
built-in modules (``BUILTIN``) are imported first, then every entry point once, lazily, on
the first use of the registry (``load_plugins`` again takes in distributions installed
since).  A plugin never breaks the built-ins: one that fails to import, names no store
class or names a scheme already taken (a built-in's scheme stays the built-in's) is
skipped with a ``StorePluginWarning`` naming the entry point, its distribution and why.

The package, one module per part: ``keys`` (the chain and segment names), ``settings``
(``Option``), ``registry`` (``ChunkStore``, ``Stored`` and the registry of schemes),
``urls`` (checking a URL, ``open_store``), ``suffixed`` (a tensor-parallel rank's view of
a store), ``guard`` (every store call behind a deadline and a breaker), and the stores:
``file/`` (the store, its alias index, capacity, eviction, locking, tenants and the
structure cache of one-pass loads), ``server``, ``redis``, ``memory``, ``s3``.  It sits on a floor
of its own below the engine glue (``integrations/``) and above ``net/`` and ``store/``
(``docs/architecture.md``).
"""

from .keys import (
    ChunkKeys,
    chain,
    identity_digest,
    identity_key,
    segment_ends_at,
    segment_first,
    segment_name,
    valid_name,
)
from .registry import (
    GROUP,
    ChunkStore,
    Stored,
    StorePluginWarning,
    is_local,
    load_plugins,
    options,
    register,
    schemes,
    store_class,
    store_classes,
    unregister,
    url_forms,
)
from .settings import Option
from .urls import open_store, url_problem

__all__ = ["GROUP", "ChunkKeys", "ChunkStore", "Option", "StorePluginWarning", "Stored",
           "chain", "identity_digest", "identity_key", "is_local", "load_plugins",
           "open_store", "options", "register", "schemes", "segment_ends_at",
           "segment_first", "segment_name", "store_class", "store_classes", "unregister",
           "url_forms", "url_problem", "valid_name"]
