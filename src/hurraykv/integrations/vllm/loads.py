"""Loads of stored KV into the engine's blocks, one ``LoadJob`` per request
(``load_job.py``: its states, fetching, verifying and writing), run by one of two drivers.

``StepLoads`` (``load_mode`` sync): the step's jobs are fetched in
``start_load_kv`` and written layer by layer in ``wait_for_layer_load``, before the
forward pass reads each layer.  ``Loader`` (async): jobs run on a thread of their own,
beside the forward passes of the running requests; vLLM keeps the request in
``WAITING_FOR_REMOTE_KVS`` until ``finished`` reports it, with its failed blocks in the
same step (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``,
``get_block_ids_with_load_errors``: "no later than that same pass").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...io.checksums import DAMAGED
from .common import Context, Transfer
from .decode_buffers import DecodeBuffers
from .load_job import STATES, LoadJob
from .load_target import Fetched, Target, later_members, layer_members


def run_job(job: LoadJob, target: Target, buffers: DecodeBuffers,
            segments: dict[str, Fetched] | None = None,
            verifier: ThreadPoolExecutor | None = None) -> None:
    """A whole job, fetch to last layer (the async driver's work, and a test's); with a
    ``verifier``, layer L+1 is verified on its thread while layer L is written (hashing
    and writing are each a pass over the bytes, and neither holds the GIL)."""
    stats = target.ctx.stats
    started = time.perf_counter()
    layers = len(target.layers)
    try:
        job.fetch(target, {} if segments is None else segments)
        stats.add(fetch_seconds=time.perf_counter() - started)
        # nothing left to verify (pages placed from a file or a pool, hashed as they go
        # or not at all): no hand-over to the verifier and back at every layer
        verifier = verifier if job.pending else None
        ahead = verifier.submit(job.verify_layer, 0) if verifier and job.ok else None
        for layer in range(layers):
            if job.cancelled or not job.ok:
                break
            waited = time.perf_counter()
            checked = ahead.result() if ahead is not None else None
            stats.add(verify_seconds=time.perf_counter() - waited)  # what it added
            ahead = (verifier.submit(job.verify_layer, layer + 1)
                     if verifier is not None and layer + 1 < layers else None)
            stats.add(bytes_loaded=job.write_layer(target, layer, buffers, checked),
                      layers_written=1)
        if target.states and not job.cancelled:
            stats.add(bytes_loaded=job.write_states(target))
    except Exception as e:  # a bug of ours, a file changed underneath: a recompute
        job.fail(0, f"{type(e).__name__}: {e}")
    job.release()
    job.finish()
    stats.add(load_seconds=time.perf_counter() - started)


class StepLoads:
    """Synchronous loads: fetched before the forward pass, each layer written just before
    the forward pass reads it."""

    def __init__(self, target_of: Callable[[], Target | None], dtype: Any) -> None:
        self._target_of = target_of
        self._buffers = DecodeBuffers(dtype)
        self.jobs: list[LoadJob] = []
        self.failed: set[int] = set()  # blocks to report (plan.failed and failed chunks)
        self._verifier: ThreadPoolExecutor | None = None
        # layer -> its checks of every job of the step, started after the fetch: they run
        # on another core while the forward pass writes and computes the layers before
        self._checks: dict[int, Future] = {}

    def start(self, transfers: Iterable[Transfer], disabled: str) -> list[LoadJob]:
        target = self._target_of()
        segments: dict[str, Fetched] = {}
        jobs = [LoadJob(t) for t in transfers]
        for job in jobs:
            why = job.transfer.failed or disabled or ("no KV cache registered"
                                                      if target is None else "")
            if why:  # the scheduler matched; this worker cannot write
                job.fail_all(f"not loaded: {why}")
                continue
            started = time.perf_counter()
            try:
                job.fetch(target, segments)
            except Exception as e:  # a bug of ours is a recompute too, never a dead engine
                job.fail(0, f"{type(e).__name__}: {e}")
            elapsed = time.perf_counter() - started
            target.ctx.stats.add(fetch_seconds=elapsed, load_seconds=elapsed)
        self.jobs += jobs
        if target is not None and any(j.pending for j in self.jobs):
            if self._verifier is None:
                self._verifier = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-verify")
            step = list(self.jobs)
            for layer in range(1, len(target.layers)):
                self._checks[layer] = self._verifier.submit(
                    lambda L=layer: {id(j): j.verify_layer(L) for j in step})
        return jobs

    def write_layer(self, layer: int) -> None:
        target = self._target_of()
        if target is None or not self.jobs:
            return
        started = time.perf_counter()
        nbytes = 0
        try:
            ahead = self._checks.pop(layer, None)
            checked = ahead.result() if ahead is not None else {}
        except Exception as e:  # the checks of every job: every loaded block again
            for job in self.jobs:
                job.fail(0, f"checking layer {layer} failed ({type(e).__name__}: {e})")
            return
        target.ctx.stats.add(verify_seconds=time.perf_counter() - started)
        for job in self.jobs:
            if not job.ok:
                continue
            try:
                nbytes += job.write_layer(target, layer, self._buffers, checked.get(id(job)))
            except Exception as e:  # a file changed underneath, a page fetch that failed
                # (s3://): that job's blocks again, not the step's other jobs'
                job.fail(0, f"writing layer {layer} failed ({type(e).__name__}: {e})")
        target.ctx.stats.add(bytes_loaded=nbytes, layers_written=1,
                             load_seconds=time.perf_counter() - started)

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.shutdown(wait=False, cancel_futures=True)

    def settle(self, ctx: Context) -> tuple[list[LoadJob], set[int]]:
        """The step's jobs, counted, and every block to report failed."""
        jobs, self.jobs = self.jobs, []
        failed, self.failed = self.failed, set()
        for ahead in self._checks.values():  # layers never written (a step without them)
            ahead.cancel()
        self._checks.clear()
        for job in jobs:
            job.release()
            job.finish()
            job.count(ctx)
            failed.update(job.failed_blocks())
        return jobs, failed


class Loader:
    """Asynchronous loads on a thread of their own, one job at a time in the order the
    scheduler planned them (the store connection serves one call at a time anyway)."""


    def __init__(self, target_of: Callable[[], Target | None], dtype: Any) -> None:
        self._target_of = target_of
        self._buffers = DecodeBuffers(dtype)
        self._cv = threading.Condition()
        self._queue: list[LoadJob] = []
        self._jobs: dict[str, LoadJob] = {}  # not yet reported finished
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-verify")
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, transfers: Iterable[Transfer], disabled: str) -> None:
        damaged: dict[str, Fetched] = {}  # shared by the jobs of one step
        with self._cv:
            for t in transfers:
                job = LoadJob(t, segments=damaged)
                self._jobs[t.req_id] = job
                why = t.failed or disabled or ("no KV cache registered"
                                               if self._target_of() is None else "")
                if why:
                    job.fail_all(f"not loaded: {why}")
                    continue
                self._queue.append(job)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hurraykv-load")
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.pop(0)
            target = self._target_of()
            if not job.cancelled and target is not None:
                # the damage found by the jobs planned in the same step: a segment is
                # told damaged (and its chunks counted corrupt) by each, fetched by one,
                # as the jobs of one synchronous step share it; not its pages (memory)
                damaged = job.segments
                known: dict[str, Fetched] = dict(damaged)
                run_job(job, target, self._buffers, known, self._verifier)
                damaged.update((n, e) for n, e in known.items() if isinstance(e, DAMAGED))
            with self._cv:
                job.finish()
                self._cv.notify_all()

    def finished(self, finished_req_ids: Iterable[str], ctx: Context
                 ) -> tuple[list[LoadJob], set[int]]:
        """Jobs done since the last call, counted, and the blocks they failed; jobs of
        requests vLLM finished (aborted) meanwhile are cancelled and reported done (vLLM
        frees their blocks once told, ``scheduler.py`` ``_update_from_kv_xfer_finished``)."""
        for req_id in finished_req_ids:
            job = self._jobs.get(req_id)
            if job is not None and not job.done:
                job.cancel()  # no write after this returns
                ctx.stats.add(loads_cancelled=1)
        out, failed = [], set()
        with self._cv:
            for req_id, job in list(self._jobs.items()):
                if not job.done:
                    continue
                del self._jobs[req_id]
                out.append(job)
                if job.state == "cancelled":
                    continue  # its blocks are freed: nothing of it is reported failed
                job.count(ctx)
                failed.update(job.failed_blocks())
        return out, failed

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def wait_any(self, timeout: float) -> None:
        """Wait until a job is done, at most ``timeout`` (a step with no forward pass)."""
        with self._cv:
            if self._jobs and not any(j.done for j in self._jobs.values()):
                self._cv.wait(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every job submitted is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(not j.done for j in self._jobs.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Let a job being written finish (bounded), cancel the rest, stop the thread."""
        self.wait_idle(min(timeout, 1.0))
        with self._cv:
            for job in self._jobs.values():
                job.cancel()
            self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._verifier.shutdown(wait=False, cancel_futures=True)


__all__ = ["STATES", "LoadJob", "Loader", "StepLoads", "Target", "later_members",
           "layer_members", "run_job"]
