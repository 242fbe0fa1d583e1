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
FC, FS = "hurraykv/chunks/file/capacity.py", "hurraykv/chunks/file/store.py"
FL = "hurraykv/chunks/file/layouts.py"
GUARD, KS = "hurraykv/chunks/guard.py", "hurraykv/net/keystore.py"
PT = "hurraykv/net/persisted.py"
CAP = "tests/store/test_file_capacity.py"
PAGES = "tests/store/test_file_pages.py"
HANDOVER = "tests/net/test_handover.py"
SHARED = "docs/vllm.md, What is stored where (hurray:// on this host)"
ONE_PASS = "docs/vllm.md, How a request flows (3: one pass), docs/reliability.md"
CAPACITY = "docs/vllm.md, Capacity and eviction"
WRONG = "docs/vllm.md, When things go wrong"
RETAIN = "docs/vllm.md, Running it in production"
S3P, S3T = "hurraykv/chunks/s3_pages.py", "tests/store/test_s3_pages.py"
S3_LOADS = "docs/vllm.md, What is stored where (s3://: a load fetches what it places)"


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
    Mutant("file-load-not-a-use", FS, "Capacity.touch(fd)\n                size =", "size =",
           (f"{CAP}::test_eviction_takes_the_least_recently_used_in_exact_order",),
           f"{CAPACITY}: a load touches the file's mtime in any engine"),
    Mutant("file-one-pass-load-not-a-use", FS, "Capacity.touch(fd)\n            got =",
           "got =", (f"{PAGES}::test_a_one_pass_load_is_a_use_for_eviction",),
           f"{CAPACITY}: a load touches the file's mtime in any engine (a one-pass load too)"),
    Mutant("one-pass-writes-unverified-pages", "hurraykv/io/page_hash.py",
           "if (j + 1) * size > pos or (verify and xxh3(s_at + src, size)\n"
           "                                                != digests[p]):",
           "if (j + 1) * size > pos:",
           ("tests/integrations/vllm/test_vllm_direct_loads.py::"
            "test_a_damaged_page_never_reaches_its_block_and_its_blocks_are_recomputed",
            f"{PAGES}::test_a_damaged_or_missing_page_is_not_placed_and_names_its_member_and_page",
            f"{HANDOVER}::test_a_damaged_page_handed_over_never_reaches_its_block"),
           f"{ONE_PASS}: no byte reaches a block unverified; a damaged page is never written"),
    Mutant("one-pass-transpose-compiled-for-geometry-wrong", "hurraykv/io/page_hash.py",
           "                    tile[o + WIDTH] = (t1 & lo32) | (t3 << s32)",
           "                    tile[o + WIDTH] = (t0 & lo32) | (t3 << s32)",
           (f"{PAGES}::test_a_transposed_destination_gets_each_page_transposed",),
           f"{ONE_PASS}: CPU_ATTN's keys are laid out transposed, bit for bit"),
    Mutant("one-pass-small-buffers-unverified", FL,
           "if xxhash.xxh3_64_intdigest(data[o:o + n]) != d:", "if False:",
           (f"{PAGES}::test_a_damaged_block_table_is_refused_before_any_page_is_read",),
           f"{ONE_PASS}: the structure (block tables, lengths) is verified by the fetch"),
    Mutant("handover-seals-not-checked", "hurraykv/net/handover.py",
           "if seals & SEALS != SEALS:", "if False:",
           (f"{HANDOVER}::test_a_descriptor_without_the_seals_is_refused",),
           f"{SHARED}: a descriptor a reader could be cut short under is refused"),
    Mutant("handover-file-not-sealed", "hurraykv/net/handover.py",
           "fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)", "pass",
           (f"{HANDOVER}::test_a_segment_is_handed_over_sealed_and_placed_bit_for_bit",),
           f"{SHARED}: the server seals what it hands over"),
    Mutant("handover-copied-every-time", "hurraykv/net/handover.py",
           "obj.items, obj.sealed = items, sealed", "obj.sealed = None",
           (f"{HANDOVER}::test_the_object_then_lives_in_its_sealed_file_held_once",),
           f"{SHARED}: a segment is copied into its memory file once and lives there"),
    Mutant("handover-sealed-only-when-asked", "hurraykv/net/puts.py",
           "        handover.prepare(put.key, obj)\n", "        pass\n",
           (f"{HANDOVER}::test_a_server_on_a_unix_socket_seals_each_object_as_it_is_stored",),
           f"{SHARED}: objects are sealed as they are stored, off the load's path"),
    Mutant("server-store-pulls-instead-of-handover", "hurraykv/chunks/server.py",
           "if not self._share or not scatter.available():", "if True:",
           (f"{HANDOVER}::test_a_segment_is_handed_over_sealed_and_placed_bit_for_bit",
            "tests/integrations/vllm/test_vllm_direct_loads.py::test_a_server_on_this_"
            "host_hands_its_segments_over_and_they_load_in_one_pass"),
           f"{SHARED}: a server on this host hands segments over, loaded in one pass"),
    Mutant("file-no-low-water", FC,
           "target = int(limit * self.LOW_WATER)", "target = limit",
           (f"{CAP}::test_a_scan_past_the_cap_evicts_down_to_the_low_water_mark",),
           f"{CAPACITY}: the oldest are removed down to 90% of the cap"),
    Mutant("file-reservations-ignored-by-scans", FC,
           "reserved = self.reservations.live_bytes(reservations)",
           "reserved = 0 * self.reservations.live_bytes(reservations)",
           (f"{CAP}::test_a_write_in_progress_keeps_its_room_through_another_writers_rescan",),
           f"{CAPACITY}: a rescan counts the room reserved by writes in progress"),
    Mutant("file-dead-reservation-kept", "hurraykv/chunks/file/reservations.py",
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
    Mutant("file-lock-wait-30x", "hurraykv/chunks/file/locking.py",
           "deadline = time.monotonic() + seconds\n        mode =",
           "deadline = time.monotonic() + 30 * seconds\n        mode =",
           (f"{CAP}::test_a_lock_held_elsewhere_is_an_error_naming_it_not_a_wait",),
           f"{CAPACITY}: a lock held elsewhere for 5 s is an error, not a wait"),
    Mutant("file-evicts-a-segment-used-since-the-scan", "hurraykv/chunks/file/eviction.py",
           "if (st.st_ino, st.st_mtime_ns) != (entry.inode, entry.used_ns):", "if False:",
           (f"{CAP}::test_a_segment_stored_again_after_the_scan_is_not_evicted",),
           "chunks/file/eviction.py (docs/vllm.md points there): an engine never "
           "removes a segment it did not choose"),
    Mutant("file-alias-log-never-compacted", "hurraykv/chunks/file/index.py",
           "if self._log.lines <= 2 * len(keep) + slack:", "if True:",
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
    Mutant("file-replaced-log-read-on", "hurraykv/chunks/file/tenants.py",
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
    Mutant("store-load-unverified", "hurraykv/chunks/registry.py",
           'checksums.verify(snap, f"segment {name}")', "None",
           ("tests/store/test_chunk_stores.py::TestS3Store::"
            "test_damaged_values_are_refused_and_discarded",
            "tests/store/test_chunk_stores.py::TestMemoryStore::"
            "test_damaged_values_are_refused_and_discarded"),
           "docs/vllm.md, Limits: checked before any byte reaches the engine on every "
           "backend (those without a verified read of their own: s3://, mem://, a "
           "plugin's; hurray:// and redis:// verify as they receive, mutants below)"),
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
           "        spare = {keep, *targets}\n        aliases = self.aliases.nbytes",
           "        spare = set(targets)\n        aliases = self.aliases.nbytes",
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
    Mutant("damaged-chunks-not-counted", "hurraykv/integrations/vllm/load_job.py",
           "chunks_corrupt=self.corrupt,", "chunks_corrupt=0,",
           ("tests/integrations/vllm/test_vllm_worker.py::test_failed_and_corrupt_chunks_are_counted_per_chunk"
            "_and_loaded_ones_only_if_loaded",),
           "docs/vllm.md, Limits and Metrics: chunks_corrupt + the chunks loads wanted from "
           "a damaged object"),
    Mutant("resumed-request-not-loaded", "hurraykv/integrations/vllm/scheduler.py",
           "self._set_blocks(st, new_blocks)\n                self._plan_load(loads, st)",
           "self._set_blocks(st, new_blocks)",
           ("tests/integrations/vllm/test_vllm_scheduler.py::test_a_request_resumed_after_preemption_loads_"
            "what_vllm_takes_as_computed",),
           "docs/vllm.md: a hit's tokens are loaded into the blocks vLLM allocated, "
           "preempted requests included"),
    # --- loads across steps (issue 30) --------------------------------------------------
    Mutant("cancelled-load-still-written", "hurraykv/integrations/vllm/load_job.py",
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
    Mutant("planned-chunks-never-freed", "hurraykv/integrations/vllm/save_plans.py",
           "                self.planned.pop(key, None)", "                pass",
           ("tests/integrations/vllm/test_vllm_async.py::test_a_chunk_is_planned_again_once_its_save_is_"
            "reported_written_or_dropped",),
           "docs/vllm.md, How a request flows: chunks another request is storing are not "
           "copied out again only until that segment is reported written or dropped"),
    Mutant("damaged-segment-stored-under-a-new-name", "hurraykv/integrations/vllm/save_plans.py",
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
    Mutant("decode-channel-columns-swapped", "hurraykv/quant/decode.py",
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
    # --- issue 46: outside campaign 5 ---------------------------------------------------
    Mutant("ttl-unbounded", "hurraykv/io/retention.py",
           "            and 0 < ttl_s <= MAX_TTL_S):", "            and 0 < ttl_s):",
           ("tests/store/test_chunk_stores.py::TestFileStore::test_a_lifetime_that_is_not_one_"
            "is_refused_naming_ttl_s",),
           "docs/vllm.md, ttl_s: a number of seconds over 0 and at most 100 years"),
    Mutant("server-tenant-quota-whole-push", KS,
           "            if used + nbytes <= quota:", "            if used <= quota:",
           ("tests/net/test_server_tenant_quota.py::test_one_push_past_the_quota_evicts_room_"
            "for_all_of_itself",),
           "docs/operations.md, quotas: a push past the quota evicts room for all of itself"),
    Mutant("server-aliases-outside-quota", KS,
           "                self._within_quota(added, None, True, owner, targets)",
           "                pass",
           ("tests/net/test_server_tenant_quota.py::test_a_tenants_aliases_count_against_its_"
            "own_quota",),
           "docs/operations.md: --max-bytes-per-tenant bounds a tenant's aliases"),
    Mutant("server-link-evicts-its-targets", KS,
           "                self._within_quota(added, None, True, owner, targets)",
           "                self._within_quota(added, None, True, owner)",
           ("tests/net/test_server_tenant_quota.py::test_a_tenants_aliases_count_against_its_"
            "own_quota",),
           "docs/operations.md: a LINK never evicts an object being linked to"),
    Mutant("server-tenant-evicts-others", KS,
           "not self._isolated(owner) or key.startswith(owner + SEPARATOR))", "True)",
           ("tests/net/test_server_tenant_quota.py::test_a_push_within_its_quota_never_"
            "evicts_another_tenants_object",),
           "docs/operations.md: no tenant's request evicts another tenant's object"),
    Mutant("server-backing-copy-outside-quota", KS,
           "        if self._room_for_copy(key, obj.nbytes):", "        if True:",
           ("tests/net/test_server_tenant_quota.py::test_objects_pulled_back_from_the_store_"
            "stay_within_the_quota",),
           "docs/operations.md: a copy read back from --store stays within the quota"),
    Mutant("server-pinned-overwrite-unchecked", "hurraykv/net/puts.py",
           "            s.server.store.check_pin(put.key, put.nbytes)  # a pinned key: its "
           "new size",
           "            pass",
           ("tests/net/test_server_retention.py::test_an_overwrite_of_a_pinned_key_is_held_to_"
            "max_pinned_bytes",),
           "docs/spec-decisions.md H93: a push of a pinned key past the cap is refused"),
    Mutant("server-pin-keeps-old-size", KS,
           "        self._repin(key, obj.nbytes)", "        pass",
           ("tests/net/test_server_retention.py::test_an_overwrite_of_a_pinned_key_is_held_to_"
            "max_pinned_bytes",),
           "docs/spec-decisions.md H93: a pinned key pushed again stays pinned at its new size"),
    Mutant("serve-tenant-share-ignored", "hurraykv/net/server_session.py",
           "                                       > self.cfg.tenant_share())",
           "                                       > self.cfg.max_connections)",
           ("tests/net/test_server_connections.py::test_one_tenant_cannot_hold_every_connection",),
           "docs/operations.md, Connections: a tenant past its share gets SERVER_BUSY"),
    Mutant("serve-tenant-share-default-all", "hurraykv/net/config.py",
           "return max(1, self.max_connections // 4)", "return self.max_connections",
           ("tests/net/test_server_connections.py::test_one_tenant_cannot_hold_every_connection",),
           "docs/operations.md, Connections: the default share is a quarter"),
    Mutant("serve-tenant-share-over-max", "hurraykv/net/config.py",
           "if share > self.max_connections:", "if share > 2 * self.max_connections:",
           ("tests/net/test_server_connections.py::test_the_config_refuses_nonsense_shares_"
            "naming_the_option",),
           "docs/operations.md, Connections: the share is at most --max-connections"),
    Mutant("serve-tenant-share-without-tls", "hurraykv/net/server.py",
           "            if value is not None and not c.tls_ca:", "            if False:",
           ("tests/net/test_server_connections.py::test_a_share_without_tenants_is_refused",),
           "docs/operations.md, Connections: a share without --tls-ca is refused"),
    Mutant("serve-socket-file-left", "hurraykv/net/server.py",
           "        self._remove_socket_file()\n        closed = self._close_connections()",
           "        closed = self._close_connections()",
           ("tests/net/test_server_connections.py::test_a_stopped_server_removes_its_socket_"
            "file",),
           "docs/operations.md, start-up: the socket file is removed at stop"),
    Mutant("serve-socket-not-a-socket-removed", "hurraykv/net/server.py",
           "    if not stat.S_ISSOCK(mode):", "    if False:",
           ("tests/net/test_server_connections.py::test_a_file_that_is_not_a_socket_is_never_"
            "removed",),
           "docs/operations.md, start-up: a file that is not a socket is left as it is"),
    Mutant("serve-socket-live-taken-over", "hurraykv/net/server.py",
           '    raise _cannot_listen(listen, f"{path}: a server answers on it")',
           "    os.unlink(path)",
           ("tests/net/test_server_connections.py::test_a_live_servers_socket_is_not_taken_"
            "over",),
           "docs/operations.md, start-up: a live server's socket stops the start"),
    Mutant("extension-base-exception-escapes", "hurraykv/net/extensions.py",
           "    except BaseException as e:  # SystemExit, CancelledError...: the operation's, "
           "not ours",
           "    except Exception as e:",
           ("tests/net/test_private_operations.py::test_whatever_an_operation_raises_is_"
            "internal_and_the_server_serves_on",),
           "docs/spec-decisions.md H95: any exception is INTERNAL and the server carries on"),
    Mutant("extension-async-base-exception-escapes", "hurraykv/net/extensions.py",
           "        except BaseException as e:\n"
           "            if isinstance(e, asyncio.CancelledError)",
           "        except Exception as e:\n            if isinstance(e, asyncio.CancelledError)",
           ("tests/net/test_private_operations.py::test_whatever_an_operation_raises_is_"
            "internal_and_the_server_serves_on",),
           "docs/spec-decisions.md H95: the same for async operations"),
    Mutant("extension-own-cancel-unanswered", "hurraykv/net/extensions.py",
           "    return task is not None and task.cancelling() > 0",
           "    return task is not None",
           ("tests/net/test_private_operations.py::test_whatever_an_operation_raises_is_"
            "internal_and_the_server_serves_on",),
           "docs/spec-decisions.md H95: only an operation cancelled with its connection goes "
           "unanswered"),
    Mutant("extension-in-flight-unbounded", "hurraykv/net/extensions.py",
           "    if s.operations_in_flight >= MAX_IN_FLIGHT:",
           "    if s.operations_in_flight >= 1000 * MAX_IN_FLIGHT:",
           ("tests/net/test_private_operations.py::test_operations_in_flight_on_a_connection_"
            "are_bounded",),
           "docs/spec-decisions.md H95: at most 64 operations in flight a connection"),
    Mutant("plugin-systemexit-skipped", "hurraykv/plugins.py",
           "        except (Exception, SystemExit) as e:\n", "        except Exception as e:\n",
           ("tests/store/test_store_plugins.py::test_a_plugin_raising_systemexit_on_import_is_"
            "skipped_by_every_command",),
           "docs/architecture.md: a plugin raising SystemExit on import is skipped, warned of"),
    Mutant("store-open-error-named", "hurraykv/chunks/urls.py",
           "    except (Exception, SystemExit) as e:  # a plugin's own error: named, not a "
           "traceback",
           "    except SystemExit as e:  # a plugin's own error: named, not a traceback",
           ("tests/store/test_store_plugins.py::test_a_store_whose_open_raises_is_one_error_"
            "naming_the_store_and_the_cause",),
           "open_store: an open that raises is a ConfigError naming the store and the cause"),
    Mutant("store-open-timeout", "hurraykv/chunks/urls.py",
           "        if timeout is None or is_builtin(cls):  # the built-ins bound their sockets "
           "by it",
           "        if True:  # the built-ins bound their sockets by it",
           ("tests/store/test_store_plugins.py::test_a_store_whose_open_never_returns_is_given_"
            "up_after_the_timeout",),
           "open_store: a store's open is given up after the timeout"),
    Mutant("store-opened-late-closed", "hurraykv/chunks/urls.py",
           "                    with contextlib.suppress(Exception):\n"
           "                        got[0].close()",
           "                    pass",
           ("tests/store/test_store_plugins.py::test_a_store_that_opens_after_it_was_given_up_"
            "on_is_closed",),
           "open_store: a store that opens after it was given up on is closed"),
    Mutant("cache-timeout-option", "hurraykv/cli/cache.py",
           "        return _open_one(args.urls[0], settings, args.timeout)",
           "        return _open_one(args.urls[0], settings, 30.0)",
           ("tests/store/test_store_plugins.py::test_a_store_whose_open_never_returns_is_given_"
            "up_after_the_timeout",),
           "docs/vllm.md: hurraykv cache --timeout"),
    Mutant("scale-overflow-refused-on-load", "hurraykv/paged.py",
           "        _quant.check_decodable(scales, zps, self.element_type.name,",
           "        (lambda *a: None)(scales, zps, self.element_type.name,",
           ("tests/paged/test_quant.py::test_a_huge_finite_scale_is_refused_by_validate_load_"
            "and_decode",),
           "docs/spec-decisions.md H74: loading and validate refuse a scale that overflows"),
    Mutant("decode-pages-checks-scales", "hurraykv/paged_reads.py",
           "        if self.quantization is not None:\n            self.check_params_once()\n"
           "        dtype = np.dtype(dtype)",
           "        dtype = np.dtype(dtype)",
           ("tests/paged/test_quant.py::test_a_huge_finite_scale_is_refused_by_validate_load_"
            "and_decode",),
           "docs/spec-decisions.md H74: decode_pages checks scales on a first read"),
    Mutant("dequantizing-read-checks-scales", "hurraykv/paged_reads.py",
           "            self.check_params_once()\n            fused = None",
           "            fused = None",
           ("tests/paged/test_quant.py::test_a_huge_finite_scale_is_refused_by_validate_load_"
            "and_decode",),
           "docs/spec-decisions.md H74: gather/to_dense(dequantize=True) check scales"),
    Mutant("scale-refusal-names-member", "hurraykv/paged.py",
           "            if self.layer_index is None:\n                raise\n",
           "            raise\n",
           ("tests/paged/test_quant.py::test_a_huge_finite_scale_is_refused_by_validate_load_"
            "and_decode",),
           "docs/spec-decisions.md H74: the refusal names layers.L.role"),
    Mutant("quantize-counts-lowest-code", "hurraykv/quant/params.py",
           "    steps = int(farthest_code(qmin, qmax, 0 if symmetric else qmin))",
           "    steps = span",
           ("tests/paged/test_quant.py::test_quantize_refuses_a_symmetric_scale_whose_lowest_"
            "code_would_overflow",),
           "docs/spec-decisions.md H74: max(qmax, -qmin) * scale when symmetric"),
    Mutant("kernel-counts-lowest-code", "hurraykv/_numba_kernels.py",
           "        reach = np.float32(max(qmax, -qmin) if symmetric else qmax - qmin)",
           "        reach = span",
           ("tests/paged/test_quant.py::test_quantize_refuses_a_symmetric_scale_whose_lowest_"
            "code_would_overflow",),
           "docs/spec-decisions.md H74: the same, compiled"),
    Mutant("per-tensor-scale-overflow", "hurraykv/wire/quant_schemes.py",
           "        if not decodes_finitely(self.scale, steps):", "        if False:",
           ("tests/paged/test_quant.py::test_per_tensor_and_per_channel_scales_that_overflow_"
            "are_refused_on_load",),
           "docs/spec-decisions.md H74: a per-tensor scale checked by the decoder"),
    Mutant("scale-rule-own-zero-point", "hurraykv/quant/params.py",
           "    steps = farthest_code(qmin, qmax, 0 if zps is None else zps)",
           "    steps = farthest_code(qmin, qmax, 0)",
           ("tests/paged/test_quant.py::test_a_scale_just_under_the_limit_decodes_finitely_and_"
            "one_step_more_is_refused",),
           "docs/spec-decisions.md H74: max(qmax - zp, zp - qmin) * scale"),
    Mutant("config-unicode-digits", "hurraykv/integrations/vllm/config.py",
           "out = (units.parse_int if number is int else units.parse_float)(value)",
           "out = number(value)",
           ("tests/integrations/vllm/test_vllm_config.py::test_numbers_as_text_are_ascii_"
            "digits_only",),
           "docs/vllm.md: numbers given as text are ASCII digits"),
    Mutant("size-unicode-digits", "hurraykv/units.py",
           '_SIZE = re.compile(r"\\s*([+-]?[0-9]+(?:\\.[0-9]+)?)\\s*(?:([KMGT])I?)?B?\\s*", '
           're.ASCII)',
           '_SIZE = re.compile(r"\\s*([+-]?\\d+(?:\\.\\d+)?)\\s*(?:([KMGT])I?)?B?\\s*")',
           ("tests/integrations/vllm/test_vllm_config.py::test_numbers_as_text_are_ascii_"
            "digits_only",
            "tests/store/test_chunk_stores.py::test_a_numeric_option_is_ascii_digits_only"),
           "docs/vllm.md: sizes are ASCII digits"),
    Mutant("option-int-unicode-digits", "hurraykv/chunks/settings.py",
           '"int": units.parse_int,', '"int": int,',
           ("tests/store/test_chunk_stores.py::test_a_numeric_option_is_ascii_digits_only",),
           "docs/vllm.md: a store option's number is ASCII digits"),
    Mutant("file-root-refused", FS,
           'if os.path.normpath(path).strip("/") == "":', "if False:",
           ("tests/integrations/vllm/test_vllm_config.py::test_a_file_store_at_the_filesystem_"
            "root_is_refused",),
           "docs/vllm.md, the url row: file:/// is refused"),
    Mutant("saves-pending-uncounted", "hurraykv/integrations/vllm/saves.py",
           "stats.add(saves_attempted=1, saves_pending=1)", "stats.add(saves_attempted=1)",
           ("tests/integrations/vllm/test_vllm_save_counts.py::test_every_save_attempted_lands_"
            "in_one_counted_outcome_at_every_scrape",),
           "docs/vllm.md, Metrics: attempted = stored + present + dropped + deduplicated + "
           "pending at every scrape"),
    Mutant("saves-dedup-uncounted", "hurraykv/integrations/vllm/save_plans.py",
           "ctx.stats.add(saves_attempted=deduplicated, saves_deduplicated=deduplicated)",
           "ctx.stats.add()",
           ("tests/integrations/vllm/test_vllm_save_counts.py::test_every_save_attempted_lands_"
            "in_one_counted_outcome_at_every_scrape",),
           "docs/vllm.md, Metrics: the same identity"),
    Mutant("saves-cancelled-left-pending", "hurraykv/integrations/vllm/saves.py",
           "for f, _, save in pending:  # never written: dropped, not pending for ever",
           "for f, _, save in []:  # never written: dropped, not pending for ever",
           ("tests/integrations/vllm/test_vllm_save_counts.py::test_saves_still_waiting_at_"
            "shutdown_are_counted_dropped",),
           "docs/vllm.md: a save still queued at shutdown is dropped"),
    Mutant("get-finished-swapped", "hurraykv/integrations/vllm/worker.py",
           "return None, self.finished(finished_req_ids) or None",
           "return self.finished(finished_req_ids) or None, None",
           ("tests/integrations/vllm/test_vllm_async.py::test_get_finished_reports_a_load_as_"
            "received_never_as_sent",),
           "docs/vllm.md, Design: an asynchronous load is reported received by get_finished"),
    Mutant("reset-announces-nothing", "hurraykv/integrations/vllm/events.py",
           "return self.removed_hashes(list(self._announced)) if self.enabled else 0",
           "return 0",
           ("tests/integrations/vllm/test_vllm_retention.py::test_a_reset_announces_every_"
            "block_it_announced_stored_removed",),
           "docs/vllm.md: a reset announces removals to routers"),
    Mutant("store-noscript-pipe", "hurraykv/store/scripts.py",
           "lost = [i for i, r in enumerate(replies) if is_noscript(r)]", "lost = []",
           ("tests/store/test_redis_restarts.py::test_puts_after_script_flush_reload_the_"
            "scripts",
            "tests/store/test_redis_restarts.py::test_page_store_and_chunk_store_survive_a_"
            "cluster_master_restart"),
           "store/pages.py docstring, README: scripts loaded again on NOSCRIPT, in pipelines "
           "too"),
    Mutant("store-noscript-direct", "hurraykv/store/scripts.py",
           "if not is_noscript(e):", "if True:",
           ("tests/store/test_redis_restarts.py::test_puts_after_script_flush_reload_the_"
            "scripts",),
           "store/pages.py docstring: a script call reloads its script on NOSCRIPT"),
    Mutant("redis-chunks-transport", "hurraykv/chunks/redis.py",
           "from ..store.pages import reaching\n",
           "reaching = (lambda method: method)  # noqa: E731\n",
           ("tests/store/test_redis_restarts.py::test_chunk_store_survives_a_redis_restart",),
           "README: redis:// calls raise TransportError while Redis is away"),
    Mutant("store-not-serving", "hurraykv/store/reach.py",
           '_NOT_SERVING = ("ClusterDownError", "TryAgainError", "ReadOnlyError", '
           '"NoScriptError")',
           "_NOT_SERVING = ()",
           ("tests/store/test_redis_restarts.py::test_a_cluster_that_is_down_is_a_transport_"
            "error",),
           "store/pages.py docstring: a cluster down is a TransportError"),
    Mutant("store-contains-transport", "hurraykv/store/pages.py",
           "    @reaching\n    def __contains__", "    def __contains__",
           ("tests/store/test_redis_restarts.py::test_page_store_survives_a_redis_restart",),
           "store/pages.py docstring: every call raises TransportError while Redis is away"),
    Mutant("resp-closed-transport", "hurraykv/store/resp.py",
           '    return TransportError(f"redis store {where}: the server closed',
           '    return StoreError(f"redis store {where}: the server closed',
           ("tests/store/test_redis_restarts.py::test_a_connection_redis_closes_mid_read_is_a_"
            "transport_error",),
           "store/pages.py docstring: the same on the raw page path"),
    Mutant("fsck-digest", "hurraykv/store/fsck.py",
           "elif value is not None and page_digest(geometry, value) != d:", "elif False:",
           ("tests/store/test_store_fsck.py::test_fsck_removes_damaged_pages_and_rewrites_"
            "damaged_statistics",),
           "store/fsck.py, README: page bytes are verified against their key"),
    Mutant("fsck-length", "hurraykv/store/fsck.py",
           "elif value is not None and len(value) != width:", "elif False:",
           ("tests/store/test_store_fsck.py::test_fsck_removes_damaged_pages_and_rewrites_"
            "damaged_statistics",),
           "store/fsck.py: a truncated page is damaged"),
    Mutant("fsck-delete-page", "hurraykv/store/fsck.py",
           "del_if(keys=[page_key(d)], args=[value], client=pipe)",
           "pipe.exists(page_key(d))",
           ("tests/store/test_store_fsck.py::test_fsck_removes_damaged_pages_and_rewrites_"
            "damaged_statistics",),
           "store/fsck.py: a damaged page is deleted"),
    Mutant("fsck-stats-rewrite", "hurraykv/store/fsck.py",
           "    if damaged:  # refused", "    if False:  # refused",
           ("tests/store/test_store_fsck.py::test_fsck_removes_damaged_pages_and_rewrites_"
            "damaged_statistics",),
           "store/fsck.py: damaged statistics are rewritten whole"),
    Mutant("stats-damage-skipped", "hurraykv/store/capacity.py",
           '_DAMAGED_ACCOUNT = ("WRONGTYPE", "hash value is not an integer")',
           "_DAMAGED_ACCOUNT = ()",
           ("tests/store/test_store_fsck.py::test_fsck_removes_damaged_pages_and_rewrites_"
            "damaged_statistics",),
           "store/capacity.py: puts skip statistics Redis refuses as damaged"),
    Mutant("fsck-owner-set-remade", "hurraykv/store/fsck.py",
           "                owners = set()\n", "                continue\n",
           ("tests/store/test_store_fsck.py::test_fsck_removes_manifests_releases_and_owner_"
            "sets_that_are_not_theirs",),
           "store/fsck.py: owner sets are rebuilt from the manifests"),
    Mutant("fsck-cli-lines", "hurraykv/cli/store.py",
           '            print(f"damaged: page {key}: {problem} (removed)")', "            pass",
           ("tests/store/test_store_fsck.py::test_store_fsck_command_reports_and_repairs_each_"
            "damage",),
           "README: store fsck names each damaged key"),
    Mutant("token-chains-short", "hurraykv/store/manifest.py",
           "        full, page_size)", "        full, -1)",
           ("tests/store/test_store.py::test_a_sequence_shorter_than_a_page_is_indexed_by_its_"
            "full_pages_only",),
           "PageStore.put: token_ids index any sequence length by its full pages"),
    Mutant("rm-stops-at-missing", "hurraykv/cli/remote.py",
           "                missing += 1\n", "                return 1\n",
           ("tests/cli/test_cli_newcomer.py::test_rm_removes_every_key_that_exists_and_names_"
            "each_missing_one",),
           "README: rm removes every KEY that exists, names each missing one"),
    Mutant("rm-exit-0", "hurraykv/cli/remote.py",
           "    return 1 if missing else 0", "    return 0",
           ("tests/cli/test_cli_newcomer.py::test_rm_removes_every_key_that_exists_and_names_"
            "each_missing_one",),
           "README: rm exits 1 when a key is missing"),
    Mutant("missing-key-jargon", "hurraykv/cli/remote.py",
           "            raise NoSuchKey(key) from None", "            raise",
           ("tests/cli/test_cli_newcomer.py::test_a_missing_key_is_said_without_protocol_"
            "jargon",),
           "README: a missing key is said as no such key 'KEY'"),
    Mutant("empty-key-to-server", "hurraykv/cli/__init__.py",
           'sp.add_argument("key", type=_key,', 'sp.add_argument("key", type=str,',
           ("tests/cli/test_cli_newcomer.py::test_an_empty_key_is_a_usage_error_before_the_"
            "server_is_asked",),
           "hurraykv --help: an empty KEY is a usage error"),
    Mutant("ls-no-glob", "hurraykv/cli/remote.py",
           "    return found if whole is None else [n for n in found if whole.fullmatch(n[0])]",
           "    return found",
           ("tests/cli/test_cli_newcomer.py::test_ls_takes_redis_style_globs",),
           "README: ls PREFIX with * ? [ is a glob the whole key must match"),
    Mutant("ls-escape", "hurraykv/cli/remote.py",
           '(m[0][1] if escaped else "")', '(m[0] if escaped else "")',
           ("tests/cli/test_cli_newcomer.py::test_ls_takes_redis_style_globs",),
           "README: a backslash makes the next character literal in an ls glob"),
    Mutant("inspect-json-rejected", "hurraykv/cli/local.py",
           "        if args.json:  # an object on stdout for scripts, as validate --json prints",
           "        if False:",
           ("tests/cli/test_cli_newcomer.py::test_inspect_json_prints_an_object_for_a_rejected_"
            "file",),
           "hurraykv inspect --help: --json prints {path, valid: false, error}"),
    Mutant("error-subject-first", "hurraykv/cli/__init__.py",
           '    if subject and text.startswith(f"{subject}: "):', "    if False:",
           ("tests/cli/test_cli_newcomer.py::test_every_error_line_names_its_subject_first_"
            "then_the_error",),
           "cli docstring: errors read hurraykv: SUBJECT: ERRORTYPE: message"),
    Mutant("version-wraps", "hurraykv/cli/__init__.py",
           'p.add_argument("--version", action=_Version,',
           'p.add_argument("--version", action="version",',
           ("tests/cli/test_cli_newcomer.py::test_version_is_one_line_through_a_pipe_and_"
            "python_m_hurraykv_runs",),
           "hurraykv --version prints one line"),
    Mutant("python-m", "hurraykv/__main__.py", "sys.exit(main())", "main()",
           ("tests/cli/test_cli_newcomer.py::test_python_m_hurraykv_is_the_command",),
           "README: python -m hurraykv is the same command"),
    Mutant("cache-ls-dash", "hurraykv/cli/cache.py",
           "        print(UNRECORDED)", "        pass",
           ("tests/cli/test_cli_newcomer.py::test_cache_ls_says_what_a_dash_means_for_a_store_"
            "that_keeps_no_storing_time",),
           "docs/vllm.md: cache ls says what a - means"),
    Mutant("serve-backing-down-invalid", "hurraykv/net/messages.py",
           "    return ErrorCode.SERVER_BUSY if isinstance(e, TransportError) else "
           "ErrorCode.INVALID_MESSAGE",
           "    return ErrorCode.INVALID_MESSAGE",
           ("tests/store/test_redis_restarts.py::test_a_server_over_a_stopped_redis_answers_"
            "busy_then_serves_once_it_is_back",),
           "docs/spec-decisions.md H36: a push the backing --store cannot take is SERVER_BUSY"),
    Mutant("serve-silent-handshakes-hold-slots", "hurraykv/net/server_session.py",
           "        self.busy = not self.over_share and admitted > self.cfg.max_connections",
           "        self.busy = self.server.connections > self.cfg.max_connections",
           ("tests/net/test_server_connections.py::test_connections_that_never_say_hello_hold_"
            "no_other_tenants_slot",),
           "docs/operations.md, Connections: a connection past its share takes no slot"),
    Mutant("cli-unicode-digits", "hurraykv/cli/__init__.py",
           "_positive = _greater_than_zero(units.parse_int,",
           "_positive = _greater_than_zero(int,",
           ("tests/cli/test_cli_newcomer.py::test_numbers_on_the_command_line_are_ascii_"
            "digits",),
           "CHANGELOG: numbers on the command line are ASCII digits"),
    # --- issue 47: the data path ----------------------------------------------------
    Mutant("hurray-pull-hashes-as-pages-land", "hurraykv/net/client.py",
           "hashes = digests.start(msg.descriptor, asm.region) if digests is not None else None",
           "hashes = None",
           ("tests/net/test_checked_pull.py::test_verified_pull_equals_what_was_pushed_and_hashed_every_page_as_it_"
            "landed",),
           "docs/vllm.md step 3: a hurray:// receive hashes each page as it lands"),
    Mutant("hurray-verified-pull-compares-digests", "hurraykv/net/page_digests.py",
           "            checksums.verify(snapshot, what, self._computed(snapshot))",
           "            self._computed(snapshot)",
           ("tests/net/test_checked_pull.py::test_verified_pull_of_a_page_damaged_on_the_server_names_the_page",),
           "docs/vllm.md step 3: a damaged page is a ChecksumError naming it"),
    Mutant("hurray-get-checked-verifies", "hurraykv/chunks/server.py",
           "return c.pull(self.prefix + check_name(name), verify=True)",
           "return c.pull(self.prefix + check_name(name))",
           ("tests/net/test_checked_pull.py::test_a_page_damaged_in_transit_is_a_checksum_error_of_the_hurray_store",),
           "docs/vllm.md step 3: a hurray:// receive verifies every page"),
    Mutant("verified-pull-into-hashes-where-received", "hurraykv/net/dataplane.py",
           "            return self._into[0][:n]", "            return memoryview(bytearray(n))",
           ("tests/net/test_checked_pull.py::test_verified_pull_into_a_held_snapshot_checks_it_too",),
           "KVClient.pull: with into=, the caller's memory is what is hashed"),
    Mutant("pull-frame-then-other-messages", "hurraykv/net/output.py",
           "                if self._behind is not None:", "                if False:",
           ("tests/net/test_pull_frames.py::test_a_reply_sent_while_a_frame_waits_for_room_"
            "follows_the_frame",),
           "Output.send_data: messages sent meanwhile follow the frame"),
    Mutant("redis-read-buffer-never-recycled", "hurraykv/store/buffers.py",
           "if len(buf) >= size and sys.getrefcount(owner) <= idle:",
           "if len(buf) >= size and sys.getrefcount(owner) < 0:",
           ("tests/store/test_redis_reads.py::test_a_get_lands_in_one_buffer_reused_once_its_snapshot_is_gone",),
           "PageStore.get: a later get takes the buffer again once no snapshot is over it"),
    Mutant("redis-read-buffer-reused-while-alive", "hurraykv/store/buffers.py",
           "if len(buf) >= size and sys.getrefcount(owner) <= idle:",
           "if len(buf) >= size:",
           ("tests/store/test_redis_reads.py::test_a_get_lands_in_one_buffer_reused_once_its_snapshot_is_gone",),
           "PageStore.get: never reused while a snapshot over it lives"),
    Mutant("redis-read-members-apart", "hurraykv/store/reads.py",
           "block = buffers.take(sum(sizes)) if buffers is not None else None", "block = None",
           ("tests/store/test_redis_reads.py::test_a_get_lands_in_one_buffer_reused_once_its_snapshot_is_gone",),
           "store/reads.py: a segment's pages land in one recycled buffer"),
    Mutant("redis-compiled-hash-wrong-pages", "hurraykv/store/reads.py",
           "compiled(0, addresses[a + x:a + y], lengths[a + x:a + y],",
           "compiled(0, addresses[x:y], lengths[a + x:a + y],",
           ("tests/store/test_redis_reads.py::test_hashed_get_digests_are_the_checksum_entry",),
           "PageStore.get_hashed: the digests are the checksum entry's"),
    Mutant("redis-get-checked-unverified", "hurraykv/chunks/redis.py",
           "        checksums.verify(snap, f\"segment {name}\", digests)\n", "",
           ("tests/store/test_redis_reads.py::test_a_damaged_page_is_caught_in_a_recycled_buffer",),
           "docs/vllm.md: a redis:// receive verifies every page"),
    Mutant("redis-nil-last-reply-waits", "hurraykv/store/resp.py",
           "filled = at[i // 2] + pos - (ends[i - 1] if i else 0) if i % 2 == 0 \\",
           "filled = at[i // 2] if i % 2 == 0 \\",
           ("tests/store/test_redis_reads.py::test_a_missing_page_anywhere_in_a_window_is_named_and_the_connection_"
            "stays_usable",),
           "Wire.bulks_into: nothing waits for bytes the server never sends"),
    Mutant("redis-resized-page-unnamed", "hurraykv/store/reads.py",
           "if e.field != \"page\" or e.offset is None:", "if True:",
           ("tests/store/test_redis_reads.py::test_a_page_of_another_size_is_refused_naming_it",),
           "store/reads.py: a page of another size is named by layer, role and page"),
    Mutant("save-asks-what-lookup-found-missing", "hurraykv/integrations/vllm/saves.py",
           "if not (save.rewrite or save.absent) and all(store.has(save.keys)):",
           "if not save.rewrite and all(store.has(save.keys)):",
           ("tests/integrations/vllm/test_vllm_save_work.py::test_a_miss_is_stored_without_asking_the_store_what_its_lookup_found_"
            "missing",),
           "docs/vllm.md step 4: a segment its step's lookup found missing is not asked about"),
    Mutant("a-plan-built-every-step", "hurraykv/integrations/vllm/scheduler.py",
           "if not (loads or saves or async_loads):\n            return self._empty(idle)",
           "if False:\n            return self._empty(idle)",
           ("tests/integrations/vllm/test_vllm_save_work.py::test_a_step_that_loads_and_saves_nothing_builds_no_plan_and_counts_"
            "nothing",),
           "docs/vllm.md step 4: a step with nothing to do gets one shared empty plan"),
    Mutant("pool-digests-every-page-the-first", "hurraykv/io/checksum_digests.py",
           "compiled(0, bases[self._pool_of] + self._offsets, self._lengths, out)",
           "compiled(0, bases[self._pool_of], self._lengths, out)",
           ("tests/io/test_checksums.py::test_pool_digests_are_the_entry_of_the_snapshot_"
            "over_those_pools",),
           "checksums.PoolDigests: its entry equals digests'"),
    # --- tiers (issue 49): mem://, the stack, a tier's guard ---------------------------
    Mutant("memory-load-not-a-use", "hurraykv/chunks/memory.py",
           "            pool.segments.move_to_end(name)  # a load is a use\n", "",
           ("tests/store/test_memory_store.py::test_a_load_is_a_use",),
           "chunks/memory.py: a load is a use (least recently used out first)"),
    Mutant("memory-put-keeps-the-callers-buffers", "hurraykv/chunks/memory.py",
           "    return (KVCacheSnapshot.from_members(items, owner=arena), total, arena,",
           "    return (snapshot, total, arena,",
           ("tests/store/test_memory_store.py::test_a_segment_is_a_copy_of_what_was_put",),
           "chunks/memory.py: a segment is copied at put (the saver reuses its buffers)"),
    Mutant("stack-promotion-never-queued", "hurraykv/chunks/stack.py",
           'queued = [self._enqueue(t, copy, "promotions", name) for t in range(tier)]',
           "queued = []",
           ("tests/store/test_stack.py::test_a_lower_tiers_hit_is_promoted_and_the_next_"
            "comes_from_the_top",),
           "docs/vllm.md, Tiers: a lower tier's hit is promoted into the tiers above"),
    Mutant("stack-a-tier-down-fails-the-lookup", "hurraykv/chunks/stack.py",
           "            except Exception as e:  # a tier down answers misses; the others serve",
           "            except HurrayError as e:  # a tier down answers misses; the others "
           "serve",
           ("tests/store/test_stack.py::test_a_tier_down_never_fails_the_stack_the_others_"
            "serve",),
           "docs/vllm.md, Tiers: a tier that fails answers misses, the others serve"),
    Mutant("tier-guard-deadline-30x", "hurraykv/chunks/guarded_tier.py",
           "got = self.guard.call(op, run, _NO_ANSWER, timeout=self.timeouts[kind])",
           "got = self.guard.call(op, run, _NO_ANSWER, timeout=30 * self.timeouts[kind])",
           ("tests/store/test_stack.py::test_a_hung_tier_costs_its_deadline_only_and_its_"
            "breaker_recovers",),
           "docs/vllm.md, Tiers: each tier within its share of the connector's deadline"),
    Mutant("tiers-promotion-keys-not-planned", "hurraykv/integrations/vllm/scheduler.py",
           "keys = segment_keys(name, st.keys.known())", "keys = []",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_a_lower_tiers_hit_loads_and_"
            "is_promoted_so_the_next_comes_from_memory",),
           "docs/vllm.md, Tiers: the next hit of a promoted prefix comes from memory"),
    Mutant("stack-promoted-copy-not-read", "hurraykv/chunks/stack.py",
           "            self._remember(name, self.tiers.index(store), set())  # next read from "
           "there\n",
           "",
           ("tests/store/test_stack.py::test_a_lower_tiers_hit_is_promoted_and_the_next_"
            "comes_from_the_top",),
           "docs/vllm.md, Tiers: the next hit of a promoted prefix comes from memory (a "
           "worker's stack reads without looking up)"),
    Mutant("stack-late-read-forgets-the-promotion", "hurraykv/chunks/stack.py",
           "self._remember(name, tier, unless_faster_than=tried)",
           "self._remember(name, tier)",
           ("tests/store/test_stack.py::test_a_read_that_ends_after_a_promotion_leaves_the_"
            "promoted_copy_remembered",),
           "docs/vllm.md, Tiers: the next hit of a promoted prefix comes from memory (a read "
           "under way meanwhile does not undo it)"),
    Mutant("tier-hit-sources-not-kept", "hurraykv/integrations/vllm/scheduler.py",
           "st.tiers = (self.lookups.tiers(request.request_id) or [])[best:best + found]",
           "st.tiers = []",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_a_hits_tokens_are_told_by_the_"
            "tier_each_chunk_was_found_in",),
           "docs/vllm.md, Tiers: vLLM's hits by source say which tier held each chunk"),
    Mutant("tier-thresholds-not-passed-to-the-stack", "hurraykv/integrations/vllm/saves.py",
           'tiers = {} if save.tiers is None else {"tiers": save.tiers}', "tiers = {}",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_each_tier_stores_a_chunk_once_"
            "its_own_threshold_admits_it",),
           "docs/vllm.md, Tiers: each tier stores a chunk once its own store_threshold admits "
           "it"),
    Mutant("tier-thresholds-all-the-lowest", "hurraykv/integrations/vllm/admission.py",
           "out.append(tuple(t for t, n in enumerate(self.thresholds) if count >= n))",
           "out.append(self._every if count >= min(self.thresholds) else ())",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_a_run_breaks_where_its_tiers_"
            "change_and_a_promotion_is_not_admitted",),
           "docs/vllm.md, Tiers: a step's run of chunks is cut where the tiers admitting them "
           "change"),
    Mutant("stack-evictions-not-reported", "hurraykv/chunks/stack.py",
           '        self._told("removed", name, tier)\n        if tier or self.write_policy',
           "        if tier or self.write_policy",
           ("tests/store/test_stack.py::test_the_stack_reports_each_tiers_writes_and_what_it_"
            "learns_each_dropped",
            "tests/integrations/vllm/test_vllm_tiers.py::test_each_tier_announces_what_it_"
            "holds_and_what_it_dropped"),
           "docs/vllm.md, KV events: what a mem:// tier drops is announced removed there at "
           "once"),
    Mutant("tier-events-one-medium", "hurraykv/integrations/vllm/tier_events.py",
           '"CPU" if in_process(url) else "STORAGE"', '"STORAGE"',
           ("tests/integrations/vllm/test_vllm_tiers.py::test_each_tier_announces_what_it_"
            "holds_and_what_it_dropped",),
           "docs/vllm.md, KV events: a mem:// tier is vLLM's CPU medium"),
    Mutant("tier-watch-asks-the-whole-stack", "hurraykv/integrations/vllm/retention.py",
           "asked = store if tier is None else store.tiers[tier]", "asked = store",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_each_tier_announces_what_it_"
            "holds_and_what_it_dropped",),
           "docs/vllm.md, KV events: the watch checks each (segment, tier) in its own tier"),
    Mutant("tier-promotion-payload-not-kept", "hurraykv/integrations/vllm/scheduler.py",
           "                    self.events.known(st.request, segment_first(name), len(keys), "
           "name)\n", "",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_a_promotion_is_announced_in_"
            "the_tier_it_reached_and_a_reset_in_each",),
           "docs/vllm.md, KV events: a promotion is announced in the tier it reached"),
    Mutant("suffixed-evictions-untold", "hurraykv/chunks/suffixed.py",
           'watch = getattr(self.inner, "watch_evictions", None)', "watch = None",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_a_ranks_memory_tier_tells_its_"
            "evictions_by_the_plain_names",),
           "docs/vllm.md, KV events: a rank's mem:// tier tells what it drops"),
    Mutant("memory-pages-read-whole", "hurraykv/chunks/memory.py",
           "        held = self._used(name)\n        if held.held_as and ",
           "        return None\n        held = self._used(name)\n        if held.held_as and ",
           ("tests/integrations/vllm/test_vllm_direct_loads.py::test_a_memory_tiers_hit_is_"
            "placed_from_where_it_is_held_in_one_pass",),
           "docs/vllm.md, Tiers: a mem:// hit is placed into the blocks in one pass"),
    Mutant("memory-keys-held-as-segments", "hurraykv/integrations/vllm/worker.py",
           "memory.hold_as(url, forms if self.format.auto else {})",
           "memory.hold_as(url, {})",
           ("tests/integrations/vllm/test_vllm_direct_loads.py::test_a_memory_tiers_hit_is_"
            "placed_from_where_it_is_held_in_one_pass",),
           "docs/vllm.md, Tiers: a mem:// pool holds CPU_ATTN's keys as its blocks do"),
    Mutant("memory-held-form-handed-on", "hurraykv/chunks/memory.py",
           "        if not self.held_as:\n            return self.snapshot\n",
           "        if True:\n            return self.snapshot\n",
           ("tests/store/test_memory_store.py::test_a_pool_holds_keys_as_the_engine_does_and_"
            "hands_segments_on_as_they_came",),
           "docs/vllm.md, Tiers: a segment leaves a mem:// pool as it came in"),
    Mutant("guard-bounded-on-its-thread", GUARD,
           'if getattr(store, "BOUNDED", False):', "if False:",
           ("tests/store/test_guard.py::test_a_bounded_store_is_called_on_the_callers_thread_"
            "and_its_errors_still_count",),
           "docs/vllm.md, Tiers: a pool's calls are made on the caller's thread"),
    Mutant("s3-page-fetch-waits-forever", "hurraykv/chunks/s3_pages.py",
           "late = wait(futures, timeout=self._deadline).not_done",
           "late = wait(futures).not_done",
           ("tests/store/test_s3_pages.py::test_a_server_that_hangs_mid_fetch_costs_the_"
            "deadline_and_nothing_is_written_late",),
           "docs/operations.md: an s3:// load's ranged GETs are each within the store's "
           "deadline"),
    Mutant("s3-heads-per-store", "hurraykv/chunks/s3_pages.py",
           "            head = _HEADS.get((self.url, name))", "            head = None",
           ("tests/store/test_s3_pages.py::test_a_load_needs_no_head_where_a_lookup_of_this_"
            "process_made_one",),
           "docs/operations.md: no HEAD where a lookup in this process found the segment"),
    Mutant("s3-another-tenant-whole", FL,
           "            if layout is not None:\n                fetched = pools\n",
           "            if layout is not None:\n                return None\n",
           ("tests/store/test_s3_pages.py::test_a_segment_of_another_tenant_of_the_same_size_"
            "is_fetched_in_ranges_too",),
           "docs/operations.md: a segment of another tenant of that size is read in ranges"),
    Mutant("write-back-lower-thresholds-own", "hurraykv/integrations/vllm/config.py",
           "            return (own[0],) * len(own)", "            return own",
           ("tests/integrations/vllm/test_vllm_tiers.py::test_under_write_back_the_first_"
            "tiers_threshold_admits_for_the_stack",),
           "docs/vllm.md, Tiers: under write_back the first tier's threshold is the stack's"),
    Mutant("file-pages-placed-unhashed", "hurraykv/io/scatter.py",
           "    memory: np.ndarray | None = None\n    verify: bool = True\n",
           "    memory: np.ndarray | None = None\n    verify: bool = False\n",
           ("tests/integrations/vllm/test_vllm_direct_loads.py::test_a_damaged_page_never_"
            "reaches_its_block_and_its_blocks_are_recomputed",),
           f"{ONE_PASS}: a file's page is hashed before it is placed (only mem:// skips it)"),
    # --- s3:// loads in ranges (chunks/s3_pages.py) ----------------------------------
    Mutant("s3-fill-nothing", S3P,
           "        asked = self.asked(offsets, offsets + lengths)\n",
           "        return\n",
           (f"{S3T}::test_a_load_of_the_last_pages_fetches_them_and_the_structure_only",),
           f"{S3_LOADS}: a load's pages are fetched when they are placed"),
    Mutant("s3-load-fetches-whole", S3P,
           "got, known = None, self.layouts.planned(size)", "got, known = None, None",
           (f"{S3T}::test_a_load_of_the_last_pages_fetches_them_and_the_structure_only",),
           f"{S3_LOADS}: a load fetches the structure and its pages, not the whole object"),
    Mutant("s3-ranges-of-any-version", S3P,
           'options: dict[str, Any] = {} if etag is None else {"if_match": etag}',
           "options: dict[str, Any] = {}",
           (f"{S3T}::test_an_object_stored_again_while_it_is_loaded_is_a_miss_not_damage",),
           f"{S3_LOADS}: the bytes of two versions of an object are never put together"),
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
