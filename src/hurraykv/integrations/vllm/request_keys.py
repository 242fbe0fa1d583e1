"""What, besides its tokens, makes a request's KV what it is: the per-request part of the
chunk keys, matching what vLLM's own prefix cache puts in its block hashes.

vLLM's ``generate_block_hash_extra_keys`` (``vllm/v1/core/kv_cache_utils.py``) adds to a
block's hash: the LoRA adapter (``lora_name``, ``lora_path``), the request's
``cache_salt`` (so tenants never share cached prefixes, and a timing side channel
cannot tell one what another asked), multimodal feature hashes, and the hashes of prompt
embeddings.  Here the chain of chunk keys is seeded per request with the cache identity
and the adapter (name, id, path and a digest of the adapter's weight files when the path
is readable, so a name re-pointed at other weights never matches) and the salt.
Requests whose KV the key cannot identify from token ids (prompt embeddings; multimodal
inputs) are passed through: never stored, never loaded.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...chunks.keys import DIGEST


def passed_through(request: Any) -> str:
    """Why a request is neither stored nor loaded ("" when it is keyed)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings (token ids do not identify its KV)"
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    return ""


def request_seed(seed: bytes, request: Any) -> bytes:
    """The cache identity's seed, extended by the request's adapter and salt (the same
    seed, unchanged, for a plain request)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora:
        path = str(getattr(lora, "lora_path", "") or "")
        parts += [b"lora", str(lora.lora_name).encode(), str(lora.lora_int_id).encode(),
                  path.encode(), _weights_digest(path)]
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts += [b"cache_salt", str(salt).encode()]
    if not parts:
        return seed
    h = hashlib.blake2b(seed, digest_size=DIGEST)
    for p in parts:  # length-prefixed: no two lists of parts read the same
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


def tenant_of(request: Any) -> str:
    """The tenant a request stores for (``max_bytes_per_tenant``): a 64-bit digest of its
    ``cache_salt`` (the salt itself never leaves the engine); "" without one."""
    salt = getattr(request, "cache_salt", None)
    return hashlib.blake2b(str(salt).encode(), digest_size=8).hexdigest() if salt else ""


@lru_cache(maxsize=256)
def _weights_digest(path: str) -> bytes:
    """BLAKE2b of an adapter directory's weight files (names and bytes), b"" when it
    cannot be read here (a remote name: name, id and path still key it)."""
    root = Path(path)
    try:
        files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin")
                       and p.is_file()) if root.is_dir() else []
    except OSError:
        return b""
    h = hashlib.blake2b(digest_size=DIGEST)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.digest() if files else b""


__all__ = ["passed_through", "request_seed"]
