"""``file:///DIR``: segments as ``DIR/NAME.hrry`` files, aliases as lines of
``DIR/aliases.log`` (``index.py``), bounded by ``max_bytes`` (``capacity.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, unquote

import numpy as np

from ... import alloc
from ...errors import HurrayError
from ...info import is_info, parse_info
from ...io import checksums, retention, scatter
from ...io.atomic import create_temp, write_pieces
from ...io.hrry import HrryFile, read_bands
from ...io.scatter import PageSource
from ...io.snapshots import member_names, save_snapshot, snapshot_from_file
from ...snapshot import KVCacheSnapshot
from ...store.buffers import ReadBuffers
from ..keys import SEGMENT_NAME, check_name, identity_key, segment_name
from ..registry import ChunkStore, Stored
from ..settings import Option
from .capacity import Capacity, Entry, Reservation
from .index import AliasIndex
from .layouts import FileLayout, Layouts, complement, pools_of, structure_key, whole
from .tenants import TENANT

TENANT_KEY = "vllm.tenant"  # put's metadata: who stored it (max_bytes_per_tenant)


class FileChunks(ChunkStore):
    """``file:///DIR``.  Segments as ``DIR/NAME.hrry``; the chunk aliases as lines
    ``KEY NAME`` appended to ``DIR/aliases.log`` (one append per segment, read
    incrementally by every process that shares the directory; a line a crash cut short is
    ignored).

    A connector writes and reads many segments of one structure (same geometry, only the
    page values differ).  Once a file of a structure has been written and read back
    through the full rules, later ones are written in one gathered write from the same
    bytes, and a file read later whose bytes outside its page pools are exactly those of
    a file already validated gets that file's structure with its own pools - byte-equal
    structure, so the same verdict - without parsing it again."""

    SCHEMES = ("file",)
    FORM = "file:///DIR"
    LOCAL = True
    OPTIONS = (
        Option("max_bytes", "size", "Capacity of a ``file://`` directory (``\"64G\"``, "
               "``\"512M\"`` or bytes): past it the least recently used segments are "
               "evicted.  Default: unbounded (a warning at start)."),
        Option("max_pinned_bytes", "size", "Of a ``file://`` directory's ``max_bytes``, "
               "the most that pinned segments may hold: a pin past it is refused.  Default: "
               "a quarter of ``max_bytes``."),
        Option("max_bytes_per_tenant", "size", "Of a ``file://`` directory, the most that "
               "one tenant's segments may hold: past it the tenant's own least recently used "
               "segments are evicted, never another's.  Default: no quota."),
    )
    CAPACITY = "max_bytes"
    LAYOUTS = 32  # structures remembered
    COMPACT_SLACK = 4096  # alias lines beyond twice the live ones before the log is rewritten
    QUARANTINED = 16  # damaged segments kept for inspection, newest

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None = None,
                 max_pinned_bytes: int | None = None,
                 max_bytes_per_tenant: int | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = self.dir.resolve().as_uri()
        self.capacity = Capacity(self.dir, max_bytes, max_pinned_bytes, max_bytes_per_tenant)
        self._kept: tuple[Any, dict[str, retention.Kept]] = (None, {})
        self.capacity.repair()
        self.index = AliasIndex(self.dir)
        self._buffers = ReadBuffers(keep=8)  # recycled read buffers (store/buffers.py)
        self.layouts = Layouts(self.LAYOUTS)

    @classmethod
    def url_problem(cls, parsed: ParseResult) -> str:
        """A directory that is the filesystem root: segments, ``aliases.log`` and the
        quarantine would land among the system's directories, and ``hurraykv cache
        clear`` would sweep them (issue 46)."""
        path = unquote(parsed.path)
        if os.path.normpath(path).strip("/") == "":  # "/", "//", "/.", "/tmp/..", "%2F"
            return (f"its directory is the filesystem root ({parsed.path!r}); name a "
                    "directory of its own, file:///DIR")
        return ""

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> FileChunks:
        return cls(unquote(parsed.path), **options)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.hrry"

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self.capacity.evictions

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        self.index.refresh()
        kept, now = self._retained(), time.time()
        alive: dict[str, bool] = {}
        out: list[str | None] = []
        for key in keys:
            name = self.index.aliases.get(key)
            if name is not None and name not in alive:
                k = kept.get(name)
                alive[name] = _regular(self.path(name)) and not (k and k.expired(now))
            out.append(name if name is not None and alive[name] else None)
        return out

    def _retained(self) -> dict[str, retention.Kept]:
        """The pins and lifetimes, read again only when the record changed."""
        stamp = retention.mtime(self.dir)
        if stamp != self._kept[0]:
            self._kept = (stamp, retention.read(self.dir) if stamp else {})
        return self._kept[1]

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        return self.capacity.retain([check_name(n) for n in names], pin=pin, ttl_s=ttl_s,
                                    extend=extend)

    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        # No fsync: a segment lost in a crash is a future cache miss, and the atomic
        # rename still means a reader sees a whole file or none.
        name = check_name(segment_name(keys, first))
        tenant = str(metadata.get(TENANT_KEY, ""))
        if tenant and TENANT.fullmatch(tenant) is None:
            raise HurrayError(f"segment {name}: tenant {tenant[:40]!r} is not 1-32 hex "
                              "digits", field=TENANT_KEY, value=tenant[:40],
                              rule="a tenant digest")
        self.dir.mkdir(parents=True, exist_ok=True)  # an operator may have removed it
        old = self._retained().get(name)
        if old is not None and old.expired(time.time()):  # stored again: a new segment,
            self.capacity.forget(name)                    # not one past its lifetime
        structure = structure_key(snapshot) + repr(sorted(metadata.items())).encode()
        layout = self.layouts.by_structure.get(structure)
        if layout is None:
            held = self._put_first(name, structure, snapshot, metadata, tenant)
        else:  # room held first: the directory does not pass its capacity even briefly
            self.capacity.check(layout.size, name)
            held = self.capacity.admit(layout.size, name, written=False, then=self._compact,
                                       tenant=tenant)
            try:
                write_pieces(self.path(name), layout.pieces(snapshot), layout.size)
            except BaseException:
                held.release()  # nothing placed, so no scan can miss it
                raise
        try:
            # shared: a compaction (exclusive) never replaces the log under an append
            with self.capacity.lock(exclusive=False):
                # no scan runs now, and a later one lists the segment: the room it held
                # is no longer needed
                held.release()
                self.index.append(keys, name)
                if tenant and self.capacity.tenant_max is None:  # with a quota: at its
                    self.capacity.tenants.append(name, tenant)   # admission
        except (OSError, HurrayError) as e:
            # a segment no alias names is only room taken: removed, the put refused
            with contextlib.suppress(OSError):
                os.unlink(self.path(name))
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise HurrayError(f"cannot record chunk aliases in {self.dir}: {why}; segment "
                              f"{name} not stored", field="aliases",
                              value=str(self.dir)) from None
        finally:
            held.release()  # the lock refused (held elsewhere): not held for good either
        self.index.learn(keys, name)

    def _put_first(self, name: str, structure: bytes, snapshot: KVCacheSnapshot,
                   metadata: dict[str, Any], tenant: str = "") -> Reservation:
        """Store the first segment of its structure (its size known only once written):
        written as a writer's temporary file (not a segment, so not counted; locked, so
        never taken for a dead writer's) that becomes the segment once admitted, so that
        this one too never passes the capacity, even briefly; its layout is learned."""
        path = self.path(name)
        fd, tmp = create_temp(path)  # the name, taken: save_snapshot replaces it
        os.close(fd)
        try:
            # the saver hashed the segment already (checksums.with_checksums)
            save_snapshot(snapshot, tmp, metadata=metadata, fsync=False, checksums="keep")
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with contextlib.suppress(OSError):  # without flock: its age protects it
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                data = _read_fd(fd, path)
                self.capacity.check(len(data), name)
                f = HrryFile.from_bytes(data, str(path))
                self.layouts.remember(structure,
                                      FileLayout.learn(data, snapshot_from_file(f), f))
                held = self.capacity.admit(len(data), name, written=False,
                                           then=self._compact, tenant=tenant)
                try:
                    os.replace(tmp, path)  # still locked: nobody takes it for a dead writer's
                except BaseException:
                    held.release()
                    raise
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise HurrayError(f"cannot store segment {name} in {self.dir}: {e.strerror}",
                              field="path", value=str(path),
                              rule="a writable store directory") from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return held

    def _compact(self, remaining: list[Entry]) -> None:
        """The alias log rewritten with the segments still stored (``index.py``), and the
        tenants' log on the same terms (called under the exclusive lock)."""
        live = {e.name for e in remaining}
        self.capacity.tenants.owners(live)
        self.index.compact(live, self.COMPACT_SLACK)

    def get(self, name: str) -> KVCacheSnapshot:
        return self._get(name, verify=False)[0]

    def get_verified(self, name: str) -> KVCacheSnapshot:
        # A file of a structure read before is hashed while it is read (ReadPlan).
        return self._get(name, verify=True)[0]

    def get_checked(self, name: str, later: frozenset[str] = frozenset()
                    ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        return self._get(name, verify=True, later=later)

    def _get(self, name: str, verify: bool, later: frozenset[str] = frozenset()
             ) -> tuple[KVCacheSnapshot, checksums.Pending | None]:
        fd, path = self._open_segment(name)
        try:
            try:
                Capacity.touch(fd)
                size = os.fstat(fd).st_size
                known = self.layouts.planned(size) if verify else None
                if verify and known is None:
                    cold = self._first_of_structure(fd, size, path, later)
                    if cold is not None:
                        return cold
                if known is None or known.plan is None:
                    data = _read_fd(fd, path, self._buffers)
                else:
                    data = memoryview(self._buffers.take(size))
                    got, computed, hashing, skipped = known.plan.read(fd, data, later)
                    whole(path.name, size, got)
            finally:
                os.close(fd)
        except OSError as e:
            raise HurrayError(f"segment {name} in {self.dir}: {e.strerror}", field="segment",
                              value=name) from None
        what = f"segment {name}"
        if known is not None and known.matches(data):
            snap = known.read(data)
            return snap, self._verified(snap, data, what, known.plan, computed, hashing,
                                        skipped, later)
        snap = self.layouts.parse(data, str(path))
        if verify:
            started = time.perf_counter()
            checksums.verify(snap, what)
            self.verify_seconds += time.perf_counter() - started
        return snap, None

    def _open_segment(self, name: str) -> tuple[int, Path]:
        """Segment ``name``'s file, opened to read (a link is not followed), and its path;
        a HurrayError when it is not there or cannot be opened."""
        path = self.path(check_name(name))
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW), path
        except FileNotFoundError:
            raise HurrayError(f"segment {name} is not in {self.dir}", field="segment",
                              value=name, rule="a stored segment") from None
        except OSError as e:
            raise HurrayError(f"segment {name} in {self.dir}: {e.strerror}", field="segment",
                              value=name) from None

    def get_pages(self, name: str, members: frozenset[str]
                  ) -> tuple[KVCacheSnapshot, PageSource] | None:
        """Segment ``name`` with the pages of ``members`` left in its file (a
        ``PageSource``: read, verified and placed by ``io.scatter``, one pass): everything
        else read with small reads and verified now.  None where that cannot be (no
        compiled reader, no checksums, a pool that is not one whole member's pages): the
        caller reads the segment whole (``get_checked``).  The snapshot's pools for
        ``members`` are untouched memory, never read."""
        check_name(name)
        if not scatter.available():
            return None
        fd, path = self._open_segment(name)
        try:
            Capacity.touch(fd)
            got = self.layouts.pages(fd, name, str(path), members)
        except BaseException:
            os.close(fd)
            raise
        if got is None:
            os.close(fd)
            return None
        snap, source, seconds = got
        self.verify_seconds += seconds
        return snap, source

    SCAN_ON_START = 4096  # directory entries looked at by learn_layouts

    def learn_layouts(self, members: frozenset[str]) -> int:
        """Learn the file layout of the newest segment of each size in the directory (at
        most half of ``LAYOUTS``, among its first ``SCAN_ON_START`` entries), so that a
        process's first load of each is read at the speed of the rest: their structure
        is parsed now, at start-up (small reads, a few ms each), not inside a hit.  How
        many were learned."""
        newest: dict[int, tuple[int, str]] = {}
        with contextlib.suppress(OSError), os.scandir(self.dir) as entries:
            for i, entry in enumerate(entries):
                if i >= self.SCAN_ON_START:
                    break
                if not entry.name.endswith(".hrry") or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size not in self.layouts.by_size and st.st_mtime_ns > newest.get(
                            st.st_size, (-1, ""))[0]:
                        newest[st.st_size] = (st.st_mtime_ns, entry.name)
        learned = 0
        for _, name in sorted(newest.values(), reverse=True)[:self.LAYOUTS // 2]:
            path = self.dir / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                learned += self.layouts.structure_only(fd, str(path), members) is not None
            except (HurrayError, OSError):  # damaged or gone: its load will say
                pass
            finally:
                os.close(fd)
        return learned

    def _verified(self, snap: KVCacheSnapshot, data: memoryview, what: str,
                  plan: checksums.ReadPlan, computed: Any, hashing: float, skipped: Any,
                  later: frozenset[str]) -> checksums.Pending | None:
        """Check what the read hashed; what it left for later is the Pending returned."""
        started = time.perf_counter()
        checksums.verify(snap, what, plan.complete(snap, computed, skipped))
        pending = plan.pending(snap, data, what, later) if len(skipped) else None
        self.verify_seconds += hashing + time.perf_counter() - started
        return pending

    def _first_of_structure(self, fd: int, size: int, path: Path, later: frozenset[str]
                            ) -> tuple[KVCacheSnapshot, checksums.Pending | None] | None:
        """A verified read of a file of a structure not seen yet, as fast as a known one:
        its structure parsed from small reads first (header, descriptors, index buffers,
        index), so that its pages are hashed while the bulk is read; None when the file
        does not parse (the caller reads it whole and says why)."""
        data = memoryview(self._buffers.take(size))
        try:
            f = HrryFile.over(fd, data, str(path))
            pools = pools_of(f)
            for off, piece in complement(data, pools):  # data is not the file yet: offsets
                whole(path.name, len(piece), read_bands(fd, data[off:off + len(piece)], off))
            structure = complement(data, pools)
            snap = snapshot_from_file(f)
            plan = checksums.ReadPlan.of(snap, data)
        except HurrayError:
            return None
        if plan is None:
            return None
        got, computed, hashing, skipped = plan.read(fd, data, later)
        whole(path.name, size, got)
        if complement(data, pools) != structure:  # replaced between the two reads
            return None
        snap.tensors()  # every member built: index buffers and token counts checked
        self.layouts.remember(structure_key(snap), FileLayout.learn(data, snap, f, plan))
        return snap, self._verified(snap, data, f"segment {path.stem}", plan, computed,
                                    hashing, skipped, later)

    def close(self) -> None:
        self.capacity.close()  # the files it evicted removed from the disk

    def catalog(self) -> list[Stored]:
        """Every segment file, its identity read from its info member (small reads of
        its index, not its pages), its modification time as its last use."""
        out, kept = [], self._retained()
        with os.scandir(self.dir) as entries:
            names = [e.name[:-5] for e in entries if e.name.endswith(".hrry")
                     and SEGMENT_NAME.fullmatch(e.name[:-5])]
        for name in sorted(names):
            path = self.path(name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # removed since the listing, or a planted link
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                identity = _identity(fd, path)
            finally:
                os.close(fd)
            k = kept.get(name)
            out.append(Stored(name, st.st_size, identity_key(identity) if identity else None,
                              identity, used=st.st_mtime, pinned=bool(k and k.pinned),
                              expiry=k.expiry if k else None,
                              version=(st.st_ino, st.st_mtime_ns)))
        return out

    def remove(self, name: str) -> bool:
        return self.capacity.drop(check_name(name))

    def exists(self, names: Sequence[str]) -> list[bool]:
        kept, now = self._retained(), time.time()  # past its lifetime: gone, file or not
        return [_regular(self.path(check_name(n))) and not (
            n in kept and kept[n].expired(now)) for n in names]

    def discard(self, name: str) -> None:
        """Moved to ``DIR/quarantine/`` (kept for inspection, never read by a lookup)."""
        check_name(name)
        quarantine = self.dir / "quarantine"
        quarantine.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path(name), quarantine / f"{name}.hrry")
        kept = []
        for p in quarantine.glob("*.hrry"):
            with contextlib.suppress(OSError):  # another engine's clean-up got there first
                kept.append((p.stat().st_mtime_ns, p))
        for _, old in sorted(kept)[:-self.QUARANTINED]:  # evidence, not a second cache
            old.unlink(missing_ok=True)


def _identity(fd: int, path: Path) -> str | None:
    """The cache identity a segment file was stored under (its info member's model),
    read with small reads of its index and info member; None where it has none."""
    try:
        f = HrryFile.index(fd, str(path))
        for name in member_names(f):
            desc = f.descriptor(name)
            if is_info(desc):
                off, n = f.spans(name)[0]
                info = parse_info(desc, [os.pread(fd, n, off)])
                if info is not None:
                    return info[0]
    except (HurrayError, OSError, ValueError):  # damaged: listed, of no identity
        return None
    return None


def _regular(path: Path) -> bool:
    """A regular file itself, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_fd(fd: int, path: Path, buffers: ReadBuffers | None = None) -> memoryview:
    """File ``fd``'s bytes, read (``preadv``, in bands on every core) into memory of our
    own.  Not mapped: a mapped file truncated underneath kills the reader with SIGBUS,
    where a read just comes up short, which is an error (and a recompute)."""
    size = os.fstat(fd).st_size
    if not size:
        return memoryview(b"")
    buf = buffers.take(size) if buffers is not None else alloc.empty((size,), np.uint8)
    view = memoryview(buf)
    whole(path.name, size, read_bands(fd, view))
    return view


__all__ = ["FileChunks"]
