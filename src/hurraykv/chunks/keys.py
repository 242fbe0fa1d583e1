"""Chunk keys and segment names: the BLAKE2b chain over a sequence's tokens that names
each whole chunk, and the ``LASTKEY-FIRST`` names of the segments that hold runs of them
(the package docstring says why they are built so)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from ..errors import HurrayError

SEED = b"hurraykv-chunks-v1"
DIGEST = 16
# A chunk key: the hex digest, with ``.tpRANK`` for one tensor-parallel rank's objects; a
# segment name: its last chunk's key and its first chunk's index.
KEY = rb"[0-9a-f]{32}(?:\.tp[0-9]{1,4})?"
SEGMENT_NAME = re.compile(KEY.decode() + r"-[0-9]{1,9}")
ALIAS_LINE = re.compile(rb"(" + KEY + rb") (" + KEY + rb"-[0-9]{1,9})")


def check_name(name: str) -> str:
    """``name`` if it is a segment name (so a path built from it stays in the store's
    directory), else a HurrayError naming the rule."""
    if not isinstance(name, str) or SEGMENT_NAME.fullmatch(name) is None:
        raise HurrayError(f"segment name {name!r} is not KEY-FIRST (32 hex digits, an "
                          "optional .tpRANK, '-', the first chunk's index)", field="segment",
                          value=name, rule="the segment-name grammar")
    return name


def identity_digest(identity: str) -> bytes:
    return hashlib.blake2b(SEED + identity.encode("utf-8"), digest_size=DIGEST).digest()


def chain(previous: bytes, tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """The chained digests of each whole chunk of ``tokens``, continuing ``previous``."""
    full = len(tokens) // chunk_size
    data = np.ascontiguousarray(np.asarray(tokens[:full * chunk_size], dtype="<i8"))
    out = []
    for row in data.reshape(full, chunk_size) if full else ():
        previous = hashlib.blake2b(previous + row.tobytes(), digest_size=DIGEST).digest()
        out.append(previous)
    return out


class ChunkKeys:
    """The keys of one growing sequence, computed once per chunk."""

    def __init__(self, seed: bytes, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._digests: list[bytes] = []
        self._seed = seed

    def upto(self, tokens: Sequence[int], count: int) -> list[str]:
        """Keys of the first ``count`` chunks (``tokens`` holds at least that many)."""
        have = len(self._digests)
        if count > have:
            start = have * self.chunk_size
            prev = self._digests[-1] if self._digests else self._seed
            self._digests += chain(prev, tokens[start:count * self.chunk_size], self.chunk_size)
        return [d.hex() for d in self._digests[:count]]

    def known(self) -> list[str]:
        """The keys computed so far (of the chunks looked up)."""
        return [d.hex() for d in self._digests]


def valid_name(name: str | None) -> str | None:
    """A name a store returned, or None (a miss) when it is not a segment name."""
    return name if name is not None and SEGMENT_NAME.fullmatch(name) else None


def segment_name(keys: Sequence[str], first: int) -> str:
    return f"{keys[-1]}-{first}"


def segment_ends_at(name: str, key: str) -> bool:
    """Segment ``name`` ends with chunk ``key`` (its name is its last key and first index)."""
    return name.rpartition("-")[0] == key


def segment_keys(name: str, keys: Sequence[str]) -> list[str]:
    """The chunk keys of segment ``name``, out of a sequence's ``keys`` (chunk 0 first):
    from its first chunk through its last; [] when ``keys`` are not its sequence's or do
    not reach its end."""
    first = segment_first(name)
    last = name.rpartition("-")[0]
    keys = list(keys)
    try:
        end = keys.index(last, first)
    except ValueError:
        return []
    return list(keys[first:end + 1])


def segment_first(name: str) -> int:
    """The index of a segment's first chunk, from its name (checked)."""
    return int(check_name(name).rsplit("-", 1)[1])




def identity_key(identity: str) -> str:
    """How a catalog names an identity: its digest, 32 hex digits."""
    return identity_digest(identity).hex()

