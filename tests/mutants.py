"""A mutation check of documented behaviour (issue 35): each mutant below removes one claim
of the docs from a copy of the source, and the tests named with it must then fail.  A
mutant whose tests still pass ("SURVIVED") is a claim that nothing checks.

    .venv/bin/python tests/mutants.py            # every mutant (`make mutants`)
    .venv/bin/python tests/mutants.py -k file-   # those whose name contains "file-"
    .venv/bin/python tests/mutants.py --list

The real tree is never edited: ``src/`` is copied to a temporary directory, put first on
``PYTHONPATH`` (ahead of the editable install), and each mutant is applied to the copy
and undone after its run.  A mutant's old text must be found exactly once in its file,
or the run stops before anything runs: code that moved means a mutant to update, never
one silently skipped.  The tests of every mutant are first run once against the
unmutated copy (the baseline): a test that fails anyway would count every mutant killed.

A mutant is killed when its tests fail (pytest's exit status 1) or run past
``--timeout`` (a broken deadline may hang); any other status (a test not found, a
collection error) is an error, reported as such.  The exit status is 0 only when every
mutant was killed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FC, FS = "hurraykv/integrations/file_capacity.py", "hurraykv/integrations/file_store.py"
GUARD, KS = "hurraykv/integrations/guard.py", "hurraykv/net/keystore.py"
PT = "hurraykv/net/persisted.py"
CAP = "tests/store/test_file_capacity.py"
CAPACITY = "docs/vllm.md, Capacity and eviction"
WRONG = "docs/vllm.md, When things go wrong"
RETAIN = "docs/vllm.md, Running it in production"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/
    old: str  # found exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids (or files)
    claim: str  # where the behaviour is documented, and what it says


MUTANTS = [
    # --- file:// capacity (max_bytes) ------------------------------------------------
    Mutant("file-lru-by-name", FC,
           "out.sort(key=lambda e: e.used_ns)", "out.sort(key=lambda e: e.name)",
           (f"{CAP}::test_eviction_takes_the_least_recently_used_in_exact_order",),
           f"{CAPACITY}: file:// evicts segments by last use"),
    Mutant("file-lru-reversed", FC,
           "out.sort(key=lambda e: e.used_ns)",
           "out.sort(key=lambda e: e.used_ns, reverse=True)",
           (f"{CAP}::test_eviction_takes_the_least_recently_used_in_exact_order",),
           f"{CAPACITY}: file:// evicts the least recently used first"),
    Mutant("file-load-not-a-use", FS, "Capacity.touch(fd)", "None",
           (f"{CAP}::test_eviction_takes_the_least_recently_used_in_exact_order",),
           f"{CAPACITY}: a load touches the file's mtime in any engine"),
    Mutant("file-no-low-water", FC,
           "target = int(limit * self.LOW_WATER)", "target = limit",
           (f"{CAP}::test_a_scan_past_the_cap_evicts_down_to_the_low_water_mark",),
           f"{CAPACITY}: the oldest are removed down to 90% of the cap"),
    Mutant("file-reservations-ignored-by-scans", FC,
           "reserved = self._reserved(reservations)",
           "reserved = 0 * self._reserved(reservations)",
           (f"{CAP}::test_a_write_in_progress_keeps_its_room_through_another_writers_rescan",),
           f"{CAPACITY}: a rescan counts the room reserved by writes in progress"),
    Mutant("file-dead-reservation-kept", FC,
           "                with contextlib.suppress(OSError):\n"
           "                    os.unlink(path)\n            finally:",
           "                total += nbytes\n            finally:",
           (f"{CAP}::test_the_reservation_of_a_killed_writer_is_reclaimed",),
           f"{CAPACITY}: a killed writer's reservation is reclaimed"),
    Mutant("file-future-scan-time-trusted", FC,
           "if count < 0 or not 0 < when <= time.time():", "if count < 0:",
           (f"{CAP}::test_a_usage_record_with_a_scan_time_not_in_the_past_is_rescanned",),
           f"{CAPACITY}: a damaged record, such as a scan time not in the past, means a "
           "rescan"),
    Mutant("file-room-wait-30x", FC,
           "deadline = time.monotonic() + self.LOCK_SECONDS\n        pause = 0.005",
           "deadline = time.monotonic() + 30 * self.LOCK_SECONDS\n        pause = 0.005",
           (f"{CAP}::test_room_held_by_writes_in_progress_is_waited_for_then_refused",),
           f"{CAPACITY}: a save waits for writes in progress up to 5 s, then is dropped"),
    Mutant("file-lock-wait-30x", FC,
           "deadline = time.monotonic() + self.LOCK_SECONDS\n            mode =",
           "deadline = time.monotonic() + 30 * self.LOCK_SECONDS\n            mode =",
           (f"{CAP}::test_a_lock_held_elsewhere_is_an_error_naming_it_not_a_wait",),
           f"{CAPACITY}: a lock held elsewhere for 5 s is an error, not a wait"),
    Mutant("file-evicts-a-segment-used-since-the-scan", FC,
           "if (st.st_ino, st.st_mtime_ns) != (entry.inode, entry.used_ns):", "if False:",
           (f"{CAP}::test_a_segment_stored_again_after_the_scan_is_not_evicted",),
           "integrations/file_capacity.py (docs/vllm.md points there): an engine never "
           "removes a segment it did not choose"),
    Mutant("file-alias-log-never-compacted", FS,
           "if self._log.lines <= 2 * len(keep) + self.COMPACT_SLACK:", "if True:",
           (f"{CAP}::test_the_alias_log_is_compacted_to_what_is_stored",),
           f"{CAPACITY}: aliases.log is compacted as segments go"),
    Mutant("file-quarantine-keeps-the-oldest", FS,
           "sorted(kept)[:-self.QUARANTINED]", "sorted(kept)[self.QUARANTINED:]",
           (f"{CAP}::test_quarantine_keeps_the_newest_damaged_segments_uncounted",),
           f"{CAPACITY}: DIR/quarantine/ holds the newest 16 damaged segments"),
    Mutant("file-damaged-segment-not-quarantined", FS,
           'os.replace(self.path(name), quarantine / f"{name}.hrry")',
           "os.unlink(self.path(name))",
           ("tests/io/test_checksums.py::"
            "test_file_segments_of_one_structure_keep_their_own_checksums",),
           "docs/vllm.md, Limits: a damaged object is quarantined (DIR/quarantine/)"),
    Mutant("file-replaced-log-read-on", "hurraykv/integrations/file_tenants.py",
           "restart = (st.st_dev, st.st_ino) != self._id or st.st_size < self._read_upto",
           "restart = st.st_size < self._read_upto",
           ("tests/store/test_chunks.py::test_a_log_replaced_by_a_longer_one_is_read_from_its_start",),
           f"{WRONG}: a log that shrank or is another file is read again from its start"),
    # --- checksums on load ---------------------------------------------------------------
    Mutant("checksums-never-raise", "hurraykv/io/checksums.py",
           "_raise_for(what, mismatches(snapshot, computed), snapshot)",
           "mismatches(snapshot, computed)",
           ("tests/io/test_checksums.py",),
           f"{WRONG}: a damaged value's checksum does not match: it is recomputed"),
    Mutant("file-load-unverified", FS,
           "checksums.verify(snap, what, plan.complete(snap, computed, skipped))",
           "plan.complete(snap, computed, skipped)",
           ("tests/store/test_chunk_stores.py::TestFileStore::"
            "test_damaged_values_are_refused_and_discarded",),
           "docs/vllm.md, Limits: checked before any byte reaches the engine on every "
           "backend (file://)"),
    Mutant("server-load-unverified", "hurraykv/integrations/chunks.py",
           'checksums.verify(snap, f"segment {name}")', "None",
           ("tests/store/test_chunk_stores.py::TestServerStore::"
            "test_damaged_values_are_refused_and_discarded",),
           "docs/vllm.md, Limits: checked before any byte reaches the engine on every "
           "backend (hurray://, redis://)"),
    # --- the guard: deadlines and the circuit breaker -----------------------------------
    Mutant("guard-deadline-30x", GUARD,
           "deadline = self.timeout if timeout is None else timeout",
           "deadline = 30 * (self.timeout if timeout is None else timeout)",
           ("tests/store/test_guard.py::test_a_hung_call_never_holds_the_caller_past_its_deadline",),
           f"{WRONG}: a lookup waits at most lookup_timeout_ms, then is a miss"),
    Mutant("config-lookup-deadline-30x", "hurraykv/integrations/vllm/config.py",
           "lookup_timeout_ms: float = 2000.0", "lookup_timeout_ms: float = 60000.0",
           ("tests/integrations/vllm/test_vllm_config.py::test_the_docs_table_defaults_are_the_configs",),
           f"{WRONG}: lookup_timeout_ms (2000 ms)"),
    Mutant("guard-queues-behind-a-hung-call", GUARD,
           "skip = hung is not None or (self.down and now < self._retry_at)",
           "skip = self.down and now < self._retry_at",
           ("tests/store/test_guard.py::test_a_hung_call_never_holds_the_caller_past_its_deadline",),
           f"{WRONG}: while a call has not returned, the next calls give up at once"),
    Mutant("guard-a-call-in-flight-is-a-failure", GUARD,
           "            if skip:\n                self._skipped += 1",
           "            if skip or self._running is not None and not self._running.done():\n"
           "                self._failed_in_flight = True\n"
           "                self._count_failure(\"call\", \"an earlier call has not returned\")\n"
           "            if skip:\n                self._skipped += 1",
           ("tests/store/test_guard.py::test_calls_from_several_threads_queue_and_none_fails_for_"
            "another",),
           f"{WRONG}: the next calls are not failures of their own (issue 30: a healthy "
           "store declared down under load)"),
    Mutant("guard-hung-call-never-charged-again", GUARD,
           "            if overdue:\n                hung[1] += 1",
           "            overdue = False",
           ("tests/store/test_guard.py::test_a_hung_call_never_holds_the_caller_past_its_deadline",),
           f"{WRONG}: the hung call counts once more per deadline it runs past"),
    Mutant("guard-down-one-failure-late", GUARD,
           "if self._in_a_row >= self._failures:", "if self._in_a_row > self._failures:",
           ("tests/store/test_guard.py::test_down_after_failures_skipped_during_backoff_then_probed",),
           f"{WRONG}: after 3 failed calls in a row the store is left alone for a backoff"),
    Mutant("guard-backoff-not-doubled", GUARD,
           "self._backoff = min(self._backoff * 2, self._max_backoff)",
           "self._backoff = min(self._backoff, self._max_backoff)",
           ("tests/store/test_guard.py::test_down_after_failures_skipped_during_backoff_then_probed",),
           f"{WRONG}: a backoff of 1 s doubling up to max_backoff_s"),
    Mutant("guard-some-errors-escape", GUARD,
           "except Exception as exc:  # every error a store can raise is a miss",
           "except (ValueError, KeyError) as exc:",
           ("tests/store/test_guard.py::test_answers_in_time_and_misses_on_any_error",),
           f"{WRONG}: every exception any store can raise is caught"),
    # --- the server's memory tier (--memory-budget) ------------------------------------
    Mutant("memory-lru-by-name", KS,
           "        for key in list(self._objects):\n"
           "            if self._used() + nbytes <= budget:",
           "        for key in sorted(self._objects):\n"
           "            if self._used() + nbytes <= budget:",
           ("tests/net/test_memory_budget.py",),
           "docs/vllm.md capacity table and net/keystore.py: objects leave memory least "
           "recently used first"),
    Mutant("memory-pull-not-a-use", KS, "self._objects.move_to_end(key)", "None",
           ("tests/net/test_memory_budget.py",),
           "net/keystore.py: LRU under the memory budget (a pull is a use)"),
    Mutant("memory-evicts-the-key-being-replaced", KS,
           "                break\n            if key != keep and (lossy or self._objects[key]"
           ".durable) and not self.pinned(key):\n                self._evict_key",
           "                break\n            if (lossy or self._objects[key]"
           ".durable) and not self.pinned(key):\n                self._evict_key",
           ("tests/net/test_memory_budget.py::"
            "test_a_put_that_fails_evicts_others_never_the_value_it_replaces",),
           "net/keystore.py: never the current value of the key being replaced"),
    # --- the server's persist tier (--persist-budget) ----------------------------------
    Mutant("disk-lru-by-name", PT,
           "for key in list(self._files):", "for key in sorted(self._files):",
           ("tests/net/test_persist_budget.py::"
            "test_disk_evicts_the_least_recently_used_in_exact_order_across_a_restart",),
           "docs/vllm.md capacity table: objects leave disk least recently used first"),
    Mutant("disk-pull-not-a-use", PT,
           "        self._files.move_to_end(key)\n        t = self._tick()",
           "        t = self._tick()",
           ("tests/net/test_persist_budget.py::"
            "test_disk_evicts_the_least_recently_used_in_exact_order_across_a_restart",),
           "net/persisted.py: each read of a persisted object is a use"),
    Mutant("disk-use-not-recorded-in-mtime", PT,
           "os.utime(self._files[key], ns=(t, t))", "None",
           ("tests/net/test_persist_budget.py::"
            "test_disk_evicts_the_least_recently_used_in_exact_order_across_a_restart",),
           "net/persisted.py: recency survives a restart in the files' mtimes"),
    Mutant("disk-restart-ordered-by-name", PT,
           "for mtime, _, key, path, size in sorted(found):",
           "for mtime, _, key, path, size in sorted(found, key=lambda f: f[1]):",
           ("tests/net/test_persist_budget.py::"
            "test_disk_evicts_the_least_recently_used_in_exact_order_across_a_restart",),
           "net/persisted.py: a restart orders the files by mtime"),
    Mutant("disk-full-decided-after-evicting", PT,
           "if pinned + self.persist_reserved + nbytes > budget:",
           "if False:",
           ("tests/net/test_persist_budget.py::"
            "test_an_object_larger_than_the_whole_budget_is_refused",),
           "net/persisted.py: PersistFull before anything is written or evicted"),
    # --- the connector's counters ------------------------------------------------------
    Mutant("damaged-chunks-not-counted", "hurraykv/integrations/vllm/loads.py",
           "chunks_corrupt=self.corrupt,", "chunks_corrupt=0,",
           ("tests/integrations/vllm/test_vllm_worker.py::test_failed_and_corrupt_chunks_are_counted_per_chunk"
            "_and_loaded_ones_only_if_loaded",),
           "docs/vllm.md, Limits and Metrics: chunks_corrupt + the chunks loads wanted from "
           "a damaged object"),
    Mutant("resumed-request-not-loaded", "hurraykv/integrations/vllm/scheduler.py",
           "self._set_blocks(st, new_blocks)\n                self._plan_load(plan, st)",
           "self._set_blocks(st, new_blocks)",
           ("tests/integrations/vllm/test_vllm_scheduler.py::test_a_request_resumed_after_preemption_loads_"
            "what_vllm_takes_as_computed",),
           "docs/vllm.md: a hit's tokens are loaded into the blocks vLLM allocated, "
           "preempted requests included"),
    # --- loads across steps (issue 30) --------------------------------------------------
    Mutant("cancelled-load-still-written", "hurraykv/integrations/vllm/loads.py",
           "            if self.cancelled or not self.ok:\n                return 0",
           "            if not self.ok:\n                return 0",
           ("tests/integrations/vllm/test_vllm_stalls.py::test_a_request_aborted_while_its_load_hangs_is_"
            "released_at_once_and_never_written", "tests/integrations/vllm/test_vllm_async.py::"
            "test_job_states_follow_the_load"),
           f"{WRONG}: an aborted request's job writes nothing into its blocks after it is "
           "reported"),
    Mutant("async-load-failed-blocks-not-reported", "hurraykv/integrations/vllm/loads.py",
           "                failed.update(job.failed_blocks())\n        return out, failed",
           "        return out, failed",
           ("tests/integrations/vllm/test_vllm_async.py::test_an_async_load_with_a_damaged_segment_fails_from_"
            "its_first_chunk",),
           "docs/vllm.md, How a request flows: an async load's failed blocks are returned "
           "in the step that reports it finished"),
    Mutant("lookup-on-the-scheduler-thread", "hurraykv/integrations/vllm/lookups.py",
           "            return PENDING\n",
           "            self._cv.wait_for(lambda: req_id in self._answers)\n"
           "            return self._answers[req_id]\n",
           ("tests/integrations/vllm/test_vllm_stalls.py::test_a_lookup_that_hangs_delays_only_its_request_"
            "then_misses",),
           "docs/vllm.md, How a request flows: get_num_new_matched_tokens never waits on "
           "the store"),
    Mutant("lookups-not-batched", "hurraykv/integrations/vllm/lookups.py",
           "batch, self._queued = self._queued, {}",
           "batch = dict([next(iter(self._queued.items()))])\n"
           "                del self._queued[next(iter(batch))]",
           ("tests/integrations/vllm/test_vllm_async.py::test_lookups_asked_in_one_step_are_one_round_trip",),
           "docs/vllm.md, How a request flows: one round trip per batch of requests"),
    Mutant("planned-chunks-never-freed", "hurraykv/integrations/vllm/scheduler.py",
           "                self.planned.pop(key, None)", "                pass",
           ("tests/integrations/vllm/test_vllm_async.py::test_a_chunk_is_planned_again_once_its_save_is_"
            "reported_written_or_dropped",),
           "docs/vllm.md, How a request flows: chunks another request is storing are not "
           "copied out again only until that segment is reported written or dropped"),
    Mutant("damaged-segment-stored-under-a-new-name", "hurraykv/integrations/vllm/scheduler.py",
           "boundary = rewrite and c < len(st.located)", "boundary = False and c < len(st.located)",
           ("tests/integrations/vllm/test_vllm_async.py::test_chunks_that_failed_to_load_are_stored_again_under_"
            "their_segments_names",),
           "docs/vllm.md, How a request flows: a damaged segment is replaced, not left beside "
           "a new one"),
    # --- writes that finish (issue 29) -------------------------------------------------
    Mutant("empty-pieces-kept", "hurraykv/io/atomic.py",
           "views = [v for v in (memoryview(p).cast(\"B\") for p in pieces) if v.nbytes]",
           "views = [memoryview(p).cast(\"B\") for p in pieces]",
           ("tests/io/test_atomic_writes.py::test_an_empty_or_partly_empty_rewrite_returns",),
           "io/atomic.py: a rewrite of zero bytes returns (docs/reliability.md, issue 29)",
           ),
    Mutant("alias-compaction-on-the-caller", "hurraykv/net/aliases.py",
           "thread.start()\n        return thread",
           "thread.run()\n        return thread",
           ("tests/io/test_atomic_writes.py::test_a_compaction_runs_beside_the_caller_and_keeps_"
            "links_made_meanwhile",),
           "net/aliases.py: the alias log is compacted on its own thread, never the "
           "event loop's"),
    # --- hybrid models (issue 31) --------------------------------------------------------
    Mutant("sliding-window-keeps-every-page", "hurraykv/integrations/vllm/groups.py",
           "return end - index <= self.need", "return end - index >= 0",
           ("tests/integrations/vllm/test_vllm_hybrid.py::test_a_sliding_window_group_needs_the_blocks_of_its_"
            "window_before_a_hit",
            "tests/integrations/vllm/test_vllm_hybrid.py::test_a_sliding_layer_keeps_its_window_pages_and_names_"
            "one_zero_page_for_the_rest"),
           "docs/vllm.md, Hybrid models: a segment stores the sliding-window pages a hit "
           "at one of its chunk ends needs"),
    Mutant("mamba-hit-anywhere", "hurraykv/integrations/vllm/scheduler.py",
           "if ctx.hybrid and ctx.layout.mamba:\n            # a Mamba state",
           "if False:\n            # a Mamba state",
           ("tests/integrations/vllm/test_vllm_hybrid.py::test_a_mamba_hit_ends_where_a_stored_segment_ends",),
           "docs/vllm.md, Hybrid models: a hit ends at the end of a segment (its states)"),
    Mutant("hybrid-loads-sync", "hurraykv/integrations/vllm/scheduler.py",
           "        if self.ctx.hybrid:\n            # vLLM takes no block-level",
           "        if False:\n            # vLLM takes no block-level",
           ("tests/integrations/vllm/test_vllm_hybrid.py::test_hybrid_loads_carry_every_groups_blocks_and_fail_"
            "by_request",),
           "docs/vllm.md, Hybrid models: loads are asynchronous whatever load_mode says"),
    # --- retention (issue 32) ---------------------------------------------------------
    # --- retention (issue 32) --------------------------------------------------------
    Mutant("reset-clears-nothing", "hurraykv/integrations/vllm/scheduler.py",
           "removed = store.clear(identity_key(ctx.identity))", "removed = []",
           ("tests/integrations/vllm/test_vllm_retention.py::test_reset_clears_this_identity_and_forgets_what_"
            "was_found",),
           f"{RETAIN}, Reset: every segment of this engine's identity is removed"),
    Mutant("stale-segments-served-after-a-reset", "hurraykv/integrations/vllm/scheduler.py",
           "if not holds(name, i) or name in stale)", "if not holds(name, i))",
           ("tests/integrations/vllm/test_vllm_retention.py::test_a_segment_planned_before_a_reset_and_written_"
            "after_it_is_removed",),
           f"{RETAIN}, Reset: a segment written after the reset is not served"),
    Mutant("file-evicts-pinned-segments", FC,
           "if entry.name == keep or (k is not None and k.pinned):", "if entry.name == keep:",
           ("tests/store/test_chunk_stores.py::TestFileStore::test_a_pinned_segment_outlives_a_"
            "flood_until_released",),
           f"{RETAIN}, Retention: pinned segments are never evicted to make room"),
    Mutant("server-evicts-pinned-files", PT,
           "if not self._writing[key] and not self.pinned(key):",
           "if not self._writing[key]:",
           ("tests/net/test_server_retention.py::test_a_pin_holds_through_disk_evictions_and_a_"
            "restart",),
           "docs/operations.md: a pinned object never leaves memory or disk to make room"),
    Mutant("a-requests-ttl-undoes-a-pin", "hurraykv/io/retention.py",
           "pinned = bool(old and old.pinned) or pin is True", "pinned = pin is True",
           ("tests/store/test_chunk_stores.py::TestFileStore::test_a_requests_lifetime_never_undoes_"
            "a_pin",),
           f"{RETAIN}, Retention: a request's ask only adds a pin"),
    Mutant("removal-watch-reports-nothing", "hurraykv/integrations/vllm/retention.py",
           "                    del self._names[name]\n                    self._gone.append(name)",
           "                    del self._names[name]",
           ("tests/integrations/vllm/test_vllm_retention.py::test_the_watch_finds_the_segments_gone_from_each_"
            "store",),
           f"{RETAIN}, what routers see: a segment gone is announced removed"),
    Mutant("file-tenant-quota-ignored", FC,
           "done += self._within_quota(entries, kept, nbytes, keep, tenant, trash)",
           "done += []",
           ("tests/store/test_file_tenants.py::test_a_noisy_tenant_evicts_only_its_own_segments",),
           f"{RETAIN}, Quotas: a noisy tenant evicts only its own segments"),
    Mutant("server-tenant-quota-ignored", KS,
           "            self._within_quota(nbytes, keep, lossy, owner)", "            pass",
           ("tests/net/test_server_tenant_quota.py",),
           "docs/operations.md: --max-bytes-per-tenant evicts only that tenant's objects"),
    Mutant("store-threshold-ignored", "hurraykv/integrations/vllm/admission.py",
           "if self.threshold <= 1:", "if True:",
           ("tests/integrations/vllm/test_vllm_scheduler.py::test_store_threshold_stores_a_chunk_the_second_"
            "time_it_is_computed",),
           "docs/vllm.md, store_threshold: a chunk is stored the Nth time it is computed"),
    Mutant("page-store-drops-states", "hurraykv/store/manifest.py",
           "        write_tensor(buf, desc, bufs)\n    hurray = buf.getvalue()",
           "        pass\n    hurray = buf.getvalue()",
           ("tests/store/test_chunk_stores.py",),
           "docs/spec-decisions.md H44/H92: the page store keeps members besides the pages"),
    # --- issue 33: the newcomer's defaults ---------------------------------------------
    Mutant("save-without-checksums", "hurraykv/io/snapshots.py",
           "            snapshot = with_checksums(unchecked)",
           "            snapshot = unchecked",
           ("tests/io/test_checksums.py::test_save_snapshot_writes_checksums_by_default_and_"
            "validate_catches_a_flip",),
           "save_snapshot's docstring: checksums (the default, \"auto\") let validate catch "
           "a flipped value byte"),
    Mutant("connector-tls-unchecked", "hurraykv/integrations/vllm/config.py",
           "            store.check_options(self.store_options,\n",
           "            (lambda *a: None)(self.store_options,\n",
           ("tests/integrations/vllm/test_vllm_config.py::test_the_tls_files_are_checked_at_start_not_as_an_"
            "outage_later",),
           "docs/vllm.md, the config table: TLS files are checked at start"),
    # --- issue 34: decoding on the tensor's floor, schemes from outside the package ----
    Mutant("decode-channel-columns-swapped", "hurraykv/quant.py",
           "cols = np.tile(scales, heads) if q.axis == 2 else np.repeat(scales, dim)",
           "cols = np.repeat(scales, dim) if q.axis == 2 else np.tile(scales, heads)",
           ("tests/paged/test_decode_pages.py::test_pages_decode_by_the_spec_formula_into_"
            "the_dtype",),
           "BlockPagedTensor.decode_pages: compiled, the spec formula's values"),
    Mutant("scheme-plugins-not-loaded", "hurraykv/wire/quant_registry.py",
           "    plugins.load(ENTRY_POINTS, _load_one,",
           "    plugins.load(ENTRY_POINTS + '-off', _load_one,",
           ("tests/paged/test_decode_pages.py::test_a_scheme_from_outside_the_package_is_"
            "quantized_decoded_and_stored",),
           "docs/architecture.md, a quantization scheme: one from outside the package "
           "through the entry point group hurraykv.quant_schemes"),
]


def check(mutants: list[Mutant], src: Path) -> list[str]:
    """Why mutants cannot be applied to ``src`` (their old text not found once, or a
    mutant that changes nothing), one line each."""
    problems = []
    for m in mutants:
        path = src / m.file
        text = path.read_text() if path.is_file() else ""
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its old text is found {count} times in src/{m.file}, "
                            "not once (the code moved, or the text is ambiguous): update it")
        if m.old == m.new:
            problems.append(f"{m.name}: its new text is its old text")
    return problems


def pytest_run(tests: tuple[str, ...], env: dict[str, str], timeout: float
               ) -> tuple[int | None, str, float]:
    """pytest's exit status (None: past ``timeout``), its output and the seconds taken."""
    started = time.monotonic()
    # a session of its own: on a timeout the servers and engines its tests started go too
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-rf",
                          "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        return None, output, time.monotonic() - started
    return p.returncode, output, time.monotonic() - started


def failed(output: str) -> str:
    """The first test pytest reports failed, or the last line of its output."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    lines = output.strip().splitlines()
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="only", default="",
                        help="run only the mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the tests against the unmutated copy")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a mutant's tests may run (default 300)")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.name:44} src/{m.file}\n{'':44} {m.claim}")
        return 0
    if not mutants:
        print(f"no mutant's name contains {args.only!r}", file=sys.stderr)
        return 2
    problems = check(mutants, ROOT / "src")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hurraykv-mutants-") as tmp:
        src = Path(tmp) / "src"
        # __pycache__ comes along, mtimes kept: numba's on-disk kernels stay valid
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("*.egg-info"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(src), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        where = subprocess.run([sys.executable, "-c", "import hurraykv; print(hurraykv.__file__)"],
                               env=env, cwd=ROOT, capture_output=True, text=True)
        if not where.stdout.strip().startswith(str(src)):
            print(f"the copy is not what Python imports: {where.stdout}{where.stderr}",
                  file=sys.stderr)
            return 2
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            status, output, seconds = pytest_run(tests, env, args.timeout * 2)
            print(f"baseline: {len(tests)} test files or ids, {seconds:.1f} s, "
                  + ("passed" if status == 0 else f"status {status}"), flush=True)
            if status != 0:
                print(output[-4000:], file=sys.stderr)
                print("the tests fail without any mutant: fix them first", file=sys.stderr)
                return 2
        results: dict[str, str] = {}
        for m in mutants:
            path = src / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            try:
                status, output, seconds = pytest_run(m.tests, env, args.timeout)
            finally:
                path.write_text(original)
            if status == 1:
                verdict, why = "killed", failed(output)
            elif status is None:
                verdict, why = "killed", f"(timed out after {args.timeout:g} s)"
            elif status == 0:
                verdict, why = "SURVIVED", "the tests pass with the claim removed"
            else:
                verdict, why = "ERROR", f"pytest status {status}: {failed(output)}"
            results[m.name] = verdict
            print(f"{verdict:8} {m.name:44} {seconds:5.1f} s  {why}", flush=True)
            if verdict != "killed":
                print(f"{'':8} claim: {m.claim}\n{'':8} tests: {' '.join(m.tests)}",
                      flush=True)
    counts = {v: sum(r == v for r in results.values()) for v in ("killed", "SURVIVED", "ERROR")}
    print(", ".join(f"{n} {v}" for v, n in counts.items()) + f" of {len(results)} mutants")
    return 0 if counts["killed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
