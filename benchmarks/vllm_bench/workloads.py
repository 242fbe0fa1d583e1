"""The request streams the tables send, the same for every contender: the Zipf stream
(its prompts, order and engine spec, and one capped store over it), the scan of a hot set
through one-off prompts, and the serve table's prompts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_bench.engines import engine, hurray_conn
from vllm_bench.measurement import sampled_peak, segment_bytes


def zipf_stream(n_prompts: int, n_requests: int, s: float = 1.1, seed: int = 13) -> list[int]:
    """Which prompt each request sends: rank k drawn with probability ~ k^-s, and the
    ranks given to the prompts in a seeded random order."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_prompts + 1) ** s
    ranks = rng.choice(n_prompts, size=n_requests, p=weights / weights.sum())
    return [int(i) for i in rng.permutation(n_prompts)[ranks]]


def hot_and_one_offs(hot: int, rounds: int, between: int) -> tuple[list[int], int]:
    """A scan: ``hot`` prompts repeated ``rounds`` times, ``between`` one-off prompts
    after each hot request; the stream of prompt indices and the number of prompts."""
    n_prompts = hot + rounds * hot * between
    stream, one_off = [], iter(range(hot, n_prompts))
    for _ in range(rounds):
        for h in range(hot):
            stream += [h] + [next(one_off) for _ in range(between)]
    return stream, n_prompts


ZIPF_MAX_TOKENS = 4


def zipf_workload(model: Path, n_prompts: int, n_requests: int):
    """The Zipf table's prompts, request stream and engine spec (the same for every
    contender, and for the store dtype table's capacity rows)."""
    rng = np.random.default_rng(29)
    prompts = [rng.integers(1, 1000, 200).tolist() for _ in range(n_prompts)]
    stream = zipf_stream(n_prompts, n_requests)

    def spec(connector: dict | None, **kw) -> dict:
        # rounds=1: one request per generate() call, in stream order, each timed
        return {"model": str(model), "dtype": "float32", "prompts": [prompts[i] for i in stream],
                "max_tokens": ZIPF_MAX_TOKENS, "rounds": 1, "connector": connector,
                "block_size": 32, "prefix_caching": False} | kw

    return prompts, stream, spec


def zipf_capped(work: Path, spec, cap: int, name: str, **extra) -> tuple[dict, int, int]:
    """One hurraykv file:// engine over the stream with ``max_bytes = cap`` (and the
    connector settings in ``extra``, e.g. ``store_dtype``): its result, the peak segment
    bytes sampled while it ran and the segment bytes at the end."""
    capped = work / name
    capped.mkdir()
    with sampled_peak(capped) as peak:
        result = engine(spec(hurray_conn(capped.as_uri(), max_bytes=cap, **extra)), work, name)
    return result, peak[0], segment_bytes(capped)


SERVE_BLOCK = 32


class ServeWorkload:
    """Token-id prompts, the same for every row: ``cached`` (512-768 tokens, stored in a
    first pass, each sent ``repeats`` times in the measured pass), ``new`` (never sent
    before the measured pass), mixed in one seeded order, and ``burst`` (new prompts sent
    by every client at once, for the saves under a burst)."""

    def __init__(self, n_cached: int, repeats: int, n_new: int, n_burst: int,
                 max_tokens: int) -> None:
        rng = np.random.default_rng(31)

        def prompt() -> list[int]:
            return rng.integers(1, 1000, int(rng.integers(512, 769))).tolist()

        self.cached = [prompt() for _ in range(n_cached)]
        self.new = [prompt() for _ in range(n_new)]
        self.burst = [prompt() for _ in range(n_burst)]
        mixed = [("hit", i) for i in range(n_cached) for _ in range(repeats)] + [
            ("new", i) for i in range(n_new)]
        self.order = [mixed[i] for i in rng.permutation(len(mixed))]
        self.max_tokens = max_tokens

    def measured(self) -> list[tuple[str, list[int]]]:
        return [(kind, (self.cached if kind == "hit" else self.new)[i])
                for kind, i in self.order]


def cacheable(prompt: list[int]) -> int:
    """Prompt tokens a store can serve: whole chunks, the last prompt token computed."""
    return (len(prompt) - 1) // SERVE_BLOCK * SERVE_BLOCK

