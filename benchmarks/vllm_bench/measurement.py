"""What the tables measure beyond an engine's own result: the CPU time of a process
beside the engine, the bytes of a store on disk (and its peak while an engine runs),
percentiles, and the host's load (sampled, and raised by burner processes).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process ``pid`` and its threads so far (0 for None)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def segment_bytes(directory: Path) -> int:
    """The bytes of the segments in a file:// store (what ``max_bytes`` bounds)."""
    return sum(f.stat().st_size for f in directory.glob("*.hrry")) if directory.exists() else 0


def tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@contextlib.contextmanager
def sampled_peak(directory: Path, every: float = 0.02):
    """The largest segment total seen in ``directory`` while the block runs: ``[peak]``."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(every):
            with contextlib.suppress(OSError):  # a segment evicted between list and stat
                peak[0] = max(peak[0], segment_bytes(directory))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        peak[0] = max(peak[0], segment_bytes(directory))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class LoadSampler:
    """/proc/loadavg every 0.5 s in a thread: the 1-minute average and runnable tasks."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with open("/proc/loadavg") as f:
                fields = f.read().split()
            # the runnable count includes this thread's reading process, running now
            self.samples.append((float(fields[0]), int(fields[3].split("/")[0]) - 1))

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        if not self.samples:
            return "?"
        return (f"{self.samples[-1][0]:.1f} (runnable "
                f"{np.mean([s[1] for s in self.samples]):.1f})")


class Burners:
    """``n`` CPU burner processes (a ``while True`` loop each, nice 0) while open."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []

