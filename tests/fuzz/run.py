"""``make fuzz``: the suite's fuzz targets for longer, coverage-guided where atheris is
installed (libFuzzer's mutations steered by which lines of hurraykv an input reaches),
else with the suite's own mutator for the same time.

    python -m tests.fuzz.run [--seconds 120] [--target descriptor|hrry|stream|protocol|tenant]

Each target runs in its own process, starting from the suite's seed corpus; a finding is
saved under ``fuzz-findings/`` and makes the run exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

TARGETS = ("descriptor", "hrry", "stream", "protocol", "tenant")
OUT = Path("fuzz-findings")


def _atheris_child(target: str, seconds: int) -> int:
    import atheris

    with atheris.instrument_imports(include=["hurraykv"]):
        import hurraykv  # noqa: F401
        from tests.fuzz import targets
    corpus = OUT / f"corpus-{target}"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(targets.seeds(target)):
        (corpus / f"seed-{i}").write_bytes(seed)

    def one(data: bytes) -> None:
        targets.check(target, data)

    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-rss_limit_mb=4096",
                   f"-artifact_prefix={OUT}/{target}-", "-timeout=30", str(corpus)], one)
    atheris.Fuzz()
    return 0


def _plain_child(target: str, seconds: int) -> int:
    from tests.fuzz import targets

    deadline = time.monotonic() + seconds
    seed = time.time_ns() % (1 << 32)
    done = 0
    for data in targets.inputs(target, 1 << 62, seed):
        try:
            targets.check(target, data)
        except targets.Finding as f:
            OUT.mkdir(exist_ok=True)
            path = OUT / f"{target}-seed{seed}-{done}.bin"
            path.write_bytes(data)
            print(f"{f}\nsaved {path}", file=sys.stderr)
            return 1
        done += 1
        if time.monotonic() > deadline:
            break
    print(f"{target}: {done} inputs in {seconds} s (seed {seed}), no finding")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=120, help="per target (default 120)")
    p.add_argument("--target", choices=TARGETS, action="append", help="default: all")
    p.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        try:
            import atheris  # noqa: F401
        except ImportError:
            return _plain_child(args.child, args.seconds)
        return _atheris_child(args.child, args.seconds)
    failed = []
    for target in args.target or TARGETS:
        print(f"== fuzzing {target} for {args.seconds} s", flush=True)
        code = subprocess.call([sys.executable, "-m", "tests.fuzz.run", "--child", target,
                                "--seconds", str(args.seconds)], env=dict(os.environ))
        if code:
            failed.append(target)
    if failed:
        print(f"findings in {failed}; inputs under {OUT}/", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
