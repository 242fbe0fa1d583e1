"""A chunk store from outside hurraykv: ``toy:///DIR``, segments as ``.hrry`` files under
``DIR/BUCKET/`` (``bucket``: an option of its own), registered through the
``hurraykv.chunk_stores`` entry point of the distribution beside it
(``toy_store_plugin-0.1.dist-info``).

The tests put this directory on ``sys.path`` (importlib.metadata then finds the
distribution, as an installed one) and prove that hurraykv takes the store with no edit of
its own: the registry lists it, the whole contract (``hurraykv.testing.ChunkStoreTests``)
passes, the connector's config takes its ``bucket``, ``hurraykv cache ls`` lists it."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, unquote

import hurraykv as hk
from hurraykv.chunks.keys import check_name, identity_key, segment_name, valid_name
from hurraykv.chunks.registry import ChunkStore, Stored
from hurraykv.chunks.settings import Option
from hurraykv.io import retention


class ToyChunks(ChunkStore):
    SCHEMES = ("toy",)
    FORM = "toy:///DIR"
    LOCAL = True
    OPTIONS = (Option("bucket", "str", "The subdirectory of DIR this store keeps."),)

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> ToyChunks:
        return cls(unquote(parsed.path), **options)

    def __init__(self, directory: str, bucket: str = "default") -> None:
        self.root = Path(directory) / bucket
        for part in ("segments", "aliases", "kept"):
            (self.root / part).mkdir(parents=True, exist_ok=True)
        self.url = f"toy://{Path(directory).resolve()}"

    def _file(self, name: str) -> Path:
        return self.root / "segments" / f"{check_name(name)}.hrry"

    def _write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _kept(self, name: str) -> retention.Kept | None:
        try:
            pinned, expiry, nbytes = json.loads((self.root / "kept" / name).read_text())
        except FileNotFoundError:
            return None
        return retention.Kept(pinned, expiry, nbytes)

    def _alive(self, name: str) -> bool:
        kept = self._kept(name)
        return self._file(name).exists() and not (kept and kept.expired(time.time()))

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        out: list[str | None] = []
        for key in keys:
            try:
                name = valid_name((self.root / "aliases" / key).read_text())
            except FileNotFoundError:
                name = None
            out.append(name if name is not None and self._alive(name) else None)
        return out

    def put(self, keys: Sequence[str], first: int, snapshot: hk.KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = segment_name(keys, first)
        fd, tmp = tempfile.mkstemp(dir=self.root / "segments", prefix=".tmp")
        os.close(fd)
        # the checksums put was given, kept as they are (a store never vouches for values)
        hk.save_snapshot(snapshot.with_info(metadata=metadata), tmp, checksums="keep",
                         fsync=False)
        (self.root / "kept" / name).unlink(missing_ok=True)  # stored again: afresh
        os.replace(tmp, self._file(name))
        for key in keys:
            self._write(self.root / "aliases" / key, name.encode())

    def get(self, name: str) -> hk.KVCacheSnapshot:
        if not self._alive(name):
            raise hk.HurrayError(f"segment {name} is not in {self.url}", field="segment",
                                 value=name, rule="a stored segment")
        return hk.load_snapshot(self._file(name), mmap=False)

    def catalog(self) -> list[Stored]:
        out = []
        for path in sorted((self.root / "segments").glob("*.hrry")):
            name = path.stem
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                st, model = path.stat(), hk.load_snapshot(path).model
                kept = self._kept(name)
                if kept and kept.expired(time.time()):
                    continue
                out.append(Stored(name, st.st_size, identity_key(model) if model else None,
                                  model or None, created=st.st_mtime,
                                  pinned=bool(kept and kept.pinned),
                                  expiry=kept.expiry if kept else None,
                                  version=(st.st_ino, st.st_mtime_ns)))
        return out

    def remove(self, name: str) -> bool:
        (self.root / "kept" / name).unlink(missing_ok=True)
        try:
            self._file(name).unlink()
        except FileNotFoundError:
            return False
        return True

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [self._alive(n) for n in names]

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        expiry, done = retention.expiry_of(ttl_s), []
        for name in names:
            if not self._alive(name):
                continue
            kept = retention.merged(self._kept(name), self._file(name).stat().st_size,
                                    pin=pin, expiry=expiry, extend=extend)
            path = self.root / "kept" / name
            if kept is None:
                path.unlink(missing_ok=True)
            else:
                self._write(path, json.dumps([kept.pinned, kept.expiry, kept.nbytes]).encode())
            done.append(name)
        return done

    def discard(self, name: str) -> None:
        self.remove(name)
