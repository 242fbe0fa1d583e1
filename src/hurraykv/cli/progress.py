"""A one-line progress bar on stderr, shown only after about a second and only on a
terminal; sizes in GiB and rates in GiB/s, as everywhere else the command line prints."""

from __future__ import annotations

import sys
import time

from .. import units


class Progress:
    def __init__(self, label: str, quiet: bool = False) -> None:
        self.label = label
        self.enabled = not quiet and sys.stderr.isatty()
        self.start = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if elapsed < 1.0:
            return
        frac = min(done / total, 1.0) if total else 0.0
        bar = "#" * int(frac * 30)
        of = f" of {units.size(total)}" if total else ""
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {units.size(done)}{of} "
                         f"{units.rate(done, elapsed)}")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
