"""The page store's manifest and prefix-index values (floor 4): bytes <-> fields.

Manifest: ``"HKVM" | u32 version (2) | 16-byte generation | u64 n | n Hurray bytes | u64 n |
page digests (16 bytes each, all zero for a page no sequence references) | u64 n | token
ids`` (see ``pages.py``; members that are not block-paged, a hybrid model's states,
travel whole in the Hurray bytes).  The generation is random, one per stored manifest: it is the
reference the manifest holds on each of its pages.  Version 1 (no generation, written
before references were generations) is still read; ``fsck`` upgrades it.  A prefix-index
value names the snapshot, sequence and token count where a chain of full token pages ends.
"""

from __future__ import annotations

import hashlib
import io
import struct
from typing import Any

import numpy as np

from ..errors import StoreError
from ..info import info_member
from ..io.stream import write_tensor
from ..snapshot import KVCacheSnapshot, group_head, kv_scales_member, seq_lens_member
from ..wire.cursor import Cursor
from ..wire.descriptor import decode_descriptor
from ..wire.layouts import BlockPaged
from .members import DIGEST, Member

MAGIC = b"HKVM"


def encode_manifest(snapshot: KVCacheSnapshot, members: list[Member],
                    digests: list[list[bytes]], token_ids: Any, generation: bytes) -> bytes:
    """The manifest of a snapshot being stored (its pages' digests in table order)."""
    buf = io.BytesIO()
    write_tensor(buf, group_head(snapshot.member_count()), [])
    write_tensor(buf, *seq_lens_member(snapshot.seq_lens))
    if snapshot.kv_scales is not None:
        write_tensor(buf, *kv_scales_member(snapshot.kv_scales))
    if snapshot.has_info:
        write_tensor(buf, *info_member(snapshot.model, snapshot.metadata))
    for m in members:
        buf.write(m.skeleton())
    for _, desc, bufs in snapshot.extras:  # other members (a hybrid model's states): whole
        write_tensor(buf, desc, bufs)
    hurray = buf.getvalue()
    table = b"".join(d for ds in digests for d in ds)
    tokens = b""
    if token_ids is not None:
        tokens = np.concatenate([np.asarray(t, dtype="<i8").reshape(-1)
                                 for t in split_tokens(snapshot, token_ids)]
                                or [np.zeros(0, "<i8")]).tobytes()
    return b"".join([MAGIC, struct.pack("<I", 2), generation, struct.pack("<Q", len(hurray)),
                     hurray, struct.pack("<Q", len(table)), table,
                     struct.pack("<Q", len(tokens)), tokens])


def manifest_generation(raw: bytes) -> bytes | None:
    """The generation of a version 2 manifest; None for version 1 (or no manifest)."""
    if len(raw) >= 24 and raw[:4] == MAGIC and struct.unpack_from("<I", raw, 4)[0] == 2:
        return bytes(raw[8:24])
    return None


def with_generation(raw: bytes, generation: bytes) -> bytes:
    """A version 1 manifest rewritten as version 2 with ``generation`` (fsck)."""
    return MAGIC + struct.pack("<I", 2) + generation + bytes(raw[8:])

def split_tokens(snapshot: KVCacheSnapshot, token_ids: Any) -> list[np.ndarray]:
    lens = snapshot.seq_lens
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
        if len(token_ids) != int(lens.sum()):
            raise StoreError(f"token_ids holds {len(token_ids)} ids for "
                             f"{int(lens.sum())} tokens", field="token_ids")
        return np.split(token_ids, np.cumsum(lens)[:-1])
    seqs = [np.asarray(t).reshape(-1) for t in token_ids]
    if [len(t) for t in seqs] != lens.tolist():
        raise StoreError(f"token_ids lengths {[len(t) for t in seqs]} differ from seq_lens "
                         f"{lens.tolist()}", field="token_ids")
    for t in seqs:
        if t.size and t.dtype.kind not in "iu":
            raise StoreError("token_ids are integers", field="token_ids")
    return seqs


def token_chains(tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Chained digest over each full page of token ids (engine-style prefix hashing)."""
    out, prev = [], struct.pack("<I", page_size)
    full = len(tokens) // page_size
    # (full, page_size), not (full, -1): a sequence shorter than a page has no full page
    data = np.ascontiguousarray(tokens[: full * page_size], dtype="<i8").reshape(
        full, page_size)
    for row in data:
        prev = hashlib.blake2b(prev + row.tobytes(), digest_size=DIGEST).digest()
        out.append(prev)
    return out


def prefix_value(snapshot_id: str, seq: int, count: int, generation: bytes) -> bytes:
    """``u32 n | snapshot id (n bytes) | u32 sequence | u64 tokens | 16-byte generation``:
    the generation is the manifest's that indexed it, so an entry left behind by a manifest
    that is gone (replaced, or evicted before its delete could remove the entry) never
    leads a lookup to another snapshot stored later under the same id."""
    raw = snapshot_id.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw + struct.pack("<IQ", seq, count) + generation


def _reader(raw: bytes | memoryview, what: str) -> Cursor:
    return Cursor(raw, error=StoreError, noun=what, bound=f"its {len(raw)} bytes")


def parse_prefix_value(value: bytes) -> tuple[str, int, int, bytes | None]:
    """(snapshot id, sequence, tokens, generation; None in entries written before
    generations were recorded).  A value that is not one is a :class:`StoreError`."""
    r = _reader(value, "prefix-index value")
    snapshot_id = r.text("snapshot_id")
    seq, count = r.u32("sequence"), r.u64("tokens")
    generation = None
    if r.left:
        generation = bytes(r.take(16, "generation"))
    r.end()
    return snapshot_id, seq, count, generation


def parse_manifest(snapshot_id: str, raw: bytes) -> tuple[list, list[bytes], bytes]:
    """(items: [(descriptor, buffers)], page digests, token bytes)."""
    r = _reader(raw, f"manifest of {snapshot_id!r}")
    if bytes(r.take(4, "magic")) != MAGIC:
        raise r.fail("magic", 0, bytes(raw[:4]), f"a manifest starts with {MAGIC!r}")
    version = r.u32("version")
    if version not in (1, 2):
        raise r.fail("version", 4, version, "manifest versions are 1 and 2")
    if version == 2:
        r.take(16, "generation")
    hurray = r.take(r.u64("hurray_length"), "hurray")
    tn = r.u64("digests_length")
    if tn % DIGEST:
        raise r.fail("digests_length", r.pos - 8, tn, f"a multiple of {DIGEST} bytes")
    table_raw = bytes(r.take(tn, "digests"))
    tokens = bytes(r.take(r.u64("tokens_length"), "tokens"))
    items = []
    off = 0
    while off < len(hurray):
        desc = decode_descriptor(hurray[off:])
        off += len(desc.encode())
        bufs = []
        for i, h in enumerate(desc.buffers):
            if isinstance(desc.layout, BlockPaged) and (
                    i == 0 or (i >= 3 and desc.quantization is not None
                               and desc.quantization.per_slot)):
                continue  # page data: in the page keys
            if off + h.byte_size > len(hurray):
                raise r.fail("hurray", off, h.byte_size, f"buffer {i} of a member lies "
                             f"inside the {len(hurray)} Hurray bytes")
            bufs.append(np.frombuffer(hurray[off:off + h.byte_size], np.uint8))
            off += h.byte_size
        items.append((desc, bufs))
    table = [table_raw[i:i + DIGEST] for i in range(0, len(table_raw), DIGEST)]
    return items, table, tokens
