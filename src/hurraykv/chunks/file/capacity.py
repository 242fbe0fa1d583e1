"""A byte budget over a directory of segments that several engines share (``file://``
``max_bytes``), least recently used evicted first.

*Use.*  A segment's modification time is its last use: written, or touched (``utime``)
by every load, in whichever engine.  Eviction removes the oldest first.

*Bookkeeping.*  The bytes stored are one shared record, ``DIR/.usage`` (the total and when
the directory was last scanned, padded to ``RECORD`` bytes and rewritten in place), read
and written under the exclusive lock by every writer, so every engine's writes count
against the one budget.  A write that keeps the total under the budget costs the lock,
the record and a reservation (below), about 1% of a 4 MiB save; one that would pass it, or the
first after ``RESCAN_SECONDS`` since the last scan (an operator may have removed files, a
crashed writer may not have counted its own), scans the directory and, if the real sum
would pass the budget, evicts down to ``LOW_WATER`` of it (so the next writes do not each
evict one segment).  A record that is damaged (it does not parse, its total is negative,
or its scan time is not in the past, which would put off every scan) is taken as no
record: the next write scans.

*Reservations.*  A segment of a known size is admitted before it is written, so the
directory stays within the budget: its room is held by a reservation file,
``.reserve.NAME.BYTES.XXXXXXXX``, created under the exclusive lock and ``flock``-ed by its
writer until the segment is in place.  A scan counts the finished segments and the live
reservations, so the room of a write in progress survives another writer's rescan: the
segments and the reservations never pass the budget together.  The writer removes its
reservation after the rename, under the shared lock: a scan that began before the rename
(and may have listed the directory without the segment) has ended by then, and a later
one lists the segment.  A reservation that nobody holds locked (its writer was killed;
the kernel dropped the lock) is removed, uncounted, by the next scan.  When the
reservations leave no room even with every other segment evicted, the write waits for
them up to ``LOCK_SECONDS``, then is refused (a ``HurrayError``: the save is dropped).
The first segment of a new structure (its size known once written) is written as a
writer's temporary file and admitted before it is renamed into place (``store.py``), so
it does not pass the budget either.  What is not counted: the alias log, ``quarantine/``
(the newest 16 damaged segments) and a writer's temporary file.

*Several engines.*  A scan-and-evict holds an exclusive ``flock`` on ``DIR/.lock``, so two
evictors never work from the same listing; appends to the alias log hold it shared, so
a compaction of the log (under the exclusive lock) loses no line.  A lock not granted
within ``LOCK_SECONDS`` (another process holding it) is an error naming the file, not a
writer that waits forever.  A segment is evicted
by renaming it to ``.evict.NAME.XXXXXXXX`` and then removing that name: a reader that
opened it keeps reading valid bytes (the inode lives until closed), a reader that comes
later finds no file (a miss), and no reader ever sees part of one.  If the renamed file
is not the one the scan listed (another inode or modification time: an engine stored
the same name again, or loaded it, since), it is put back unless a newer one is already
there: an engine never removes a segment it did not choose.  The renames happen under the
lock; the removals (an unlink frees the file's pages and blocks: most of what an
eviction costs) after it, on a thread of their own, so neither the saving engine nor
the others waiting for the lock wait for them; for those milliseconds the disk holds
the renamed files beside the budget.

*Crashes.*  A writer's temporary file and an evictor's ``.evict.*`` name left by a crash
are removed by the next start (``repair``), once older than ``io.atomic.STALE_SECONDS``;
its reservation, by the next scan (above).

The parts live beside this module: ``reservations.py``, ``eviction.py`` (the renames and
the remover thread), ``locking.py`` and ``tenants.py``; this one keeps the budget, the
record and the admission that ties them together.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ...errors import HurrayError
from ...io import retention
from ...io.atomic import remove_stale, write_pieces
from . import eviction, locking
from .eviction import SUFFIX, Entry
from .reservations import RESERVATION, RESERVE, SPARE, SPARE_NAME, Reservation, Reservations
from .tenants import TenantLog

USAGE = ".usage"


class Capacity:
    RESCAN_SECONDS = 60.0
    LOW_WATER = 0.9
    LOCK_SECONDS = 5.0
    LOCK_PAUSE, LOCK_PAUSE_MAX = 0.0001, 0.005  # waits for a lock held elsewhere, doubling
    RECORD = 64  # bytes of the usage record, padded: rewritten in place

    def __init__(self, directory: Path, max_bytes: int | None,
                 max_pinned_bytes: int | None = None,
                 max_bytes_per_tenant: int | None = None) -> None:
        self.dir, self.max_bytes = directory, max_bytes
        self.tenant_max = max_bytes_per_tenant
        self.tenants = TenantLog(directory)
        # pins never fill the store: a quarter of it by default (io/retention.py)
        self.max_pinned = max_pinned_bytes if max_pinned_bytes is not None else (
            max_bytes // 4 if max_bytes is not None else None)
        self.evictions = 0  # segments this process evicted
        self.evicted_bytes = 0
        self.reservations = Reservations(directory)
        self._at = str(directory) + os.sep  # paths as strings: a Path costs 3 us to join

    @contextlib.contextmanager
    def lock(self, exclusive: bool) -> Iterator[None]:
        """``DIR/.lock`` (``locking.py``): exclusive to scan and evict or compact, shared
        to append."""
        with locking.held(self._at, exclusive, self.LOCK_SECONDS, self.LOCK_PAUSE,
                          self.LOCK_PAUSE_MAX):
            yield

    def repair(self) -> list[str]:
        """Remove what a crashed writer or evictor left (once stale); the names removed."""
        return remove_stale(self.dir, fresh=True) + eviction.remove_stale_trash(self.dir)

    def scan(self) -> list[Entry]:
        """The segments in the directory, oldest use first."""
        return self._list()[0]

    def check(self, nbytes: int, name: str) -> None:
        """Refuse a segment that the budget cannot hold even alone."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise HurrayError(f"segment {name} of {nbytes} bytes is larger than max_bytes "
                              f"{self.max_bytes}: not stored", field="max_bytes",
                              value=nbytes, rule="a segment fits in max_bytes")
        if self.tenant_max is not None and nbytes > self.tenant_max:
            raise HurrayError(f"segment {name} of {nbytes} bytes is larger than "
                              f"max_bytes_per_tenant {self.tenant_max}: not stored",
                              field="max_bytes_per_tenant", value=nbytes,
                              rule="a segment fits in max_bytes_per_tenant")

    def admit(self, nbytes: int, keep: str, written: bool,
              then: Callable[[list[Entry]], None] | None = None, tenant: str = ""
              ) -> Reservation:
        """Account for segment ``keep`` of ``nbytes``, about to be written (or ``written``
        already, so a scan lists it), evicting the least recently used others when the
        directory would pass the budget.  The answer holds the room (``release`` it once
        the segment is in place, under the shared lock) and lists the entries evicted.
        ``then(remaining)`` runs under the exclusive lock after an eviction (alias
        compaction).  Room that writes in progress hold is waited for up to
        ``LOCK_SECONDS``, then the segment is refused (a HurrayError).  With
        ``max_bytes_per_tenant``, ``tenant``'s own least recently used segments make room
        for it first, so that its segments never pass its quota (``file_tenants.py``)."""
        if self.max_bytes is None and self.tenant_max is None:
            return Reservation(None, None, [])
        evicted: list[Entry] = []
        deadline = time.monotonic() + self.LOCK_SECONDS
        pause = 0.005
        try:
            while True:
                trash: list[Path] = []
                try:
                    with self.lock(exclusive=True):
                        held, total, reserved = self._admit(nbytes, keep, written, then,
                                                            evicted, trash, tenant)
                finally:
                    eviction.remove_later(trash)  # out of the store already: removed after the lock
                if held is not None:
                    return held
                if time.monotonic() > deadline:
                    raise HurrayError(
                        f"no room for segment {keep} of {nbytes} bytes in max_bytes "
                        f"{self.max_bytes}: {total} bytes would be stored, {reserved} of "
                        f"them reserved by writes in progress; not stored",
                        field="max_bytes", value=nbytes,
                        rule="stored segments and writes in progress fit in max_bytes")
                # the room is held by writes in progress (they last a write) or by
                # segments used since the scan chose them: look again shortly
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
        finally:
            self.evictions += len(evicted)
            self.evicted_bytes += sum(e.nbytes for e in evicted)

    def _admit(self, nbytes: int, keep: str, written: bool,
               then: Callable[[list[Entry]], None] | None, evicted: list[Entry],
               trash: list[Path], tenant: str = "") -> tuple[Reservation | None, int, int]:
        """One try of ``admit`` (under the exclusive lock): the reservation, or None and
        the total and reserved bytes that left no room; the segments it evicted are
        renamed out of the store, their files added to ``trash`` for the caller to
        remove."""
        limit = self.max_bytes if self.max_bytes is not None else 1 << 62
        total, scanned = self._usage()
        if total + nbytes <= limit and time.time() - scanned < self.RESCAN_SECONDS and (
                self.tenant_max is None):  # a quota counts its tenant's segments: a scan
            held = self.reservations.reserve(nbytes, keep, written, evicted)
            self._record(total + nbytes, scanned)
            return held, total + nbytes, 0
        entries, reservations = self._list()
        reserved = self.reservations.live_bytes(reservations)
        kept, now = self._kept(entries), time.time()
        done: list[Entry] = []
        for entry in entries:  # past their lifetime: removed whatever the total
            k = kept.get(entry.name)
            if k is not None and k.expired(now) and entry.name != keep:
                gone = eviction.take(self.dir, entry)
                if gone is not None:
                    trash.append(gone)
                    done.append(entry)
        if self.tenant_max is not None:
            done += self._within_quota(entries, kept, nbytes, keep, tenant, trash)
        if done:
            entries = [e for e in entries if e not in done]
        # a segment stored again under its name replaces the old file: the reservation
        # stands for both
        total = reserved + sum(e.nbytes for e in entries if written or e.name != keep) + \
            (0 if written else nbytes)
        if total > limit:
            target = int(limit * self.LOW_WATER)
            for entry in entries:
                if total <= target:
                    break
                k = kept.get(entry.name)
                if entry.name == keep or (k is not None and k.pinned):
                    continue  # pinned: never evicted to make room
                gone = eviction.take(self.dir, entry)
                if gone is not None:
                    trash.append(gone)
                    total -= entry.nbytes
                    done.append(entry)
        evicted += done
        held = self.reservations.reserve(nbytes, keep, written, evicted) \
            if total <= limit else None
        if held is not None and tenant and self.tenant_max is not None:
            # recorded before the segment is in place: no scan counts it as another's
            self.tenants.append(keep, tenant)
        # refused: the segment is not written (or the caller removes it)
        self._record(total if held is not None else total - nbytes, time.time())
        if done and then is not None:
            gone = {e.name for e in done}
            then([e for e in entries if e.name not in gone])
        return held, total, reserved

    def _list(self) -> tuple[list[Entry], list[tuple[str, int]]]:
        """The segments, oldest use first, and the reservations (name, bytes) listed."""
        out, reservations = [], []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.startswith(SPARE):  # 0 bytes: listed to reclaim dead ones
                    if SPARE_NAME.fullmatch(entry.name) and entry.is_file(
                            follow_symlinks=False):
                        reservations.append((entry.name, 0))
                    continue
                if entry.name.startswith(RESERVE):
                    m = RESERVATION.fullmatch(entry.name)
                    # a link or a directory of that name is not one (and is left alone)
                    if m is not None and entry.is_file(follow_symlinks=False):
                        reservations.append((entry.name, int(m[1])))
                    continue
                if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                if entry.is_file(follow_symlinks=False):
                    out.append(Entry(entry.name[:-len(SUFFIX)], st.st_size, st.st_mtime_ns,
                                     st.st_ino))
        out.sort(key=lambda e: e.used_ns)
        return out, reservations

    def _usage(self) -> tuple[int, float]:
        """The shared record: bytes stored and when the directory was last scanned (0: a
        scan is due: no record, or a damaged one: one that does not parse, a negative
        total, or a scan time not in the past, which would put off the next scan)."""
        try:
            fd = os.open(self._at + USAGE, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                total, scanned = os.read(fd, self.RECORD).split()
            finally:
                os.close(fd)
            count, when = int(total), float(scanned)
        except (OSError, ValueError):
            return 0, 0.0
        if count < 0 or not 0 < when <= time.time():  # nan fails both comparisons
            return 0, 0.0
        return count, when

    def _record(self, total: int, scanned: float) -> None:
        """Rewrite the record in place, under the exclusive lock (every reader holds it
        too): one ``pwrite`` of ``RECORD`` bytes, padded, so a shorter record leaves no
        digits of a longer one behind.  Not a temporary file renamed over it: on ext4 a
        rename over a file starts writeback of the new one (``auto_da_alloc``), which
        cost 0.1 ms per save on an idle disk and milliseconds on a busy one.  A record
        torn by a power loss is a wrong count until the next scan, as a lost one was."""
        # rounded down: a scan time read back is never in the future (a damaged record)
        text = f"{total} {math.floor(scanned * 1000) / 1000:.3f}".encode()
        text = text.ljust(self.RECORD - 1) + b"\n"
        try:
            fd = os.open(self._at + USAGE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
        except OSError:  # a link planted there, ...: replaced by a file of our own
            with contextlib.suppress(OSError, HurrayError):  # unwritable: admits scan
                write_pieces(self.dir / USAGE, [text], len(text))
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.pwrite(fd, text, 0)
        except OSError:  # the old count would stand: no record, so the next admit scans
            with contextlib.suppress(OSError):
                os.unlink(self.dir / USAGE)
        finally:
            os.close(fd)

    def _within_quota(self, entries: list[Entry], kept: dict[str, retention.Kept],
                      nbytes: int, keep: str, tenant: str, trash: list[Path]) -> list[Entry]:
        """Evict ``tenant``'s own least recently used segments (not pinned) until its
        segments and this one fit in its quota (under the exclusive lock); those evicted.
        A HurrayError when its pinned segments leave no room."""
        assert self.tenant_max is not None
        owners = self.tenants.owners({e.name for e in entries})
        mine = [e for e in entries if owners.get(e.name, "") == tenant and e.name != keep]
        used = nbytes + sum(e.nbytes for e in mine)
        fixed = nbytes + sum(e.nbytes for e in mine if e.name in kept and kept[e.name].pinned)
        if fixed > self.tenant_max:  # decided before anything is evicted
            raise HurrayError(
                f"segment {keep} of {nbytes} bytes: tenant {tenant or '(no cache_salt)'} "
                f"holds {fixed - nbytes} bytes pinned, and with this segment would pass "
                f"max_bytes_per_tenant {self.tenant_max}; not stored",
                field="max_bytes_per_tenant", value=fixed,
                rule="a tenant's pinned segments and a new one fit in max_bytes_per_tenant")
        done = []
        for entry in mine:  # oldest use first
            if used <= self.tenant_max:
                break
            k = kept.get(entry.name)
            if k is not None and k.pinned:
                continue
            gone = eviction.take(self.dir, entry)
            if gone is not None:
                trash.append(gone)
                done.append(entry)
                used -= entry.nbytes
        return done

    def _kept(self, entries: list[Entry]) -> dict[str, retention.Kept]:
        """The pins and lifetimes (under the exclusive lock), those of segments no longer
        listed dropped from the record."""
        kept = retention.read(self.dir)
        listed = {e.name for e in entries}
        if any(name not in listed for name in kept):
            kept = {n: k for n, k in kept.items() if n in listed}
            with contextlib.suppress(OSError, HurrayError):  # pruned at the next scan
                self._write_kept(kept)
        return kept

    def retain(self, names: list[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Pin and give a lifetime to the segments ``names`` that are stored
        (``io.retention.updated``); those retained.  ``PinRefused`` (nothing changed) when
        the pins would pass ``max_pinned`` (this process's, else the one the record
        holds)."""
        with self.lock(exclusive=True):
            now = time.time()
            kept = retention.read(self.dir)
            present = {}
            for name in dict.fromkeys(names):  # only those asked: a scan prunes the rest
                try:
                    st = os.lstat(f"{self._at}{name}{SUFFIX}")
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    present[name] = st.st_size
            self._write_kept(retention.updated(
                kept, present, pin=pin, ttl_s=ttl_s, max_pinned=self._budget(), now=now,
                extend=extend))
        return list(present)

    def _budget(self) -> int | None:
        """The pinned budget: this process's, else the one the record holds."""
        return self.max_pinned if self.max_pinned is not None else \
            retention.recorded_budget(self.dir)

    def _write_kept(self, kept: dict[str, retention.Kept]) -> None:
        retention.write(self.dir, kept, self._budget())

    def forget(self, name: str) -> None:
        """Drop ``name``'s pin and lifetime (it was removed, or stored again)."""
        with self.lock(exclusive=True):
            kept = retention.read(self.dir)
            if kept.pop(name, None) is not None:
                self._write_kept(kept)

    def drop(self, name: str) -> bool:
        """Remove segment ``name`` as an eviction does (a reader that opened it reads on,
        none finds it later), its bytes taken off the record; False if it was not there."""
        path = f"{self._at}{name}{SUFFIX}"
        with self.lock(exclusive=True):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return False
            except OSError as e:
                raise HurrayError(f"cannot remove segment {name} from {self.dir}: "
                                  f"{e.strerror}", field="segment", value=name) from None
            if not stat.S_ISREG(st.st_mode):
                return False
            trash = eviction.take(self.dir, Entry(name, st.st_size, st.st_mtime_ns, st.st_ino))
            if trash is None:  # loaded or stored again this instant: a later one's
                return False
            total, scanned = self._usage()
            if scanned:
                self._record(max(0, total - st.st_size), scanned)
            kept = retention.read(self.dir)
            if kept.pop(name, None) is not None:  # a segment stored again starts afresh
                self._write_kept(kept)
        eviction.discard(trash)
        return True

    @staticmethod
    def settle() -> None:
        """Wait until the segments this process evicted are removed from the disk."""
        eviction.settle()

    def close(self) -> None:
        """Remove the spare reservation file and wait for the evicted files' removal."""
        self.reservations.close()
        self.settle()

    @staticmethod
    def touch(fd: int) -> None:
        """A load is a use: the segment moves to the young end of the eviction order."""
        with contextlib.suppress(OSError):  # another user's file: its age stays
            os.utime(fd)


__all__ = ["Capacity", "Entry", "Reservation"]
