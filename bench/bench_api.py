"""Load benchmark of `cag serve` on loopback with the embedded model on corpora/handbook.

    python -m bench.bench_api [--requests 16] [--concurrency 1,2,4,8,16] [--configs 16:0:16,16:0:1]
        [--max-tokens 32] [--min-tokens N]

For each server configuration (CAG_WORKERS:CAG_THREADS:CAG_MAX_BATCH; 0 threads = the server's default): a real `cag
serve` process; at each concurrency, max(--requests, 3 x clients) /v1/ask requests (clients = threads with their own
httpx connection, each sending its next request when its answer arrived; answers of exactly --max-tokens tokens unless
--min-tokens says otherwise), questions from the handbook's questions.jsonl: aggregate completion tokens/s, p50/p95
latency, server TTFT p50, errors (must be 0), the mean decode batch (from /metrics), and the server's peak RSS (VmHWM)
after each level. The default pair of configurations is batched decoding (CAG_MAX_BATCH=16) and one request at a time
(CAG_MAX_BATCH=1), side by side in one run. Then time to first token of a resident hit vs a cold load (the snapshot
evicted by another corpus under CAG_RESIDENT_BYTES=1), measured by a streaming client and by the server's own timings.
Writes bench/results/api.json and bench/results/api.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from httpx_sse import EventSource

from bench.harness import cag_command, serving
from cag.compare.metrics import summarize
from cag.config import get_settings

from .common import REPO, machine, write

HANDBOOK = REPO / "corpora" / "handbook"


def pct(values: list[float], key: str) -> float:
    """compare.metrics.summarize's median/p95; NaN when every request failed."""
    return summarize(values)[key] if values else float("nan")


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            name, value = line.split(":")
            out[name] = int(value.split()[0]) * 1024
    return out


def decode_counters(url: str) -> tuple[float, float]:
    """(decode steps, decode rows) from the server's /metrics."""
    got = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("cag_decode_steps_total ", "cag_decode_rows_total ")):
            name, value = line.split()
            got[name] = float(value)
    return got.get("cag_decode_steps_total", 0.0), got.get("cag_decode_rows_total", 0.0)


def stream_ask(client: httpx.Client, corpus: str, question: str, max_tokens: int) -> dict:
    """One streaming /v1/ask: client-side time to first token event and total, plus the server's answer."""
    t0 = time.perf_counter()
    first = None
    final = None
    with client.stream("POST", "/v1/ask", json={"corpus": corpus, "question": question, "max_tokens": max_tokens,
                                                "stream": True}) as r:
        r.raise_for_status()
        for event in EventSource(r).iter_sse():
            if first is None:
                first = time.perf_counter() - t0
            if event.event == "answer":
                final = event.json()
    total = time.perf_counter() - t0
    return {"client_ttft_ms": (first or total) * 1e3, "client_total_ms": total * 1e3,
            "server_load_ms": final["timings"]["load_ms"], "server_ttft_ms": final["timings"]["ttft_ms"],
            "completion_tokens": final["usage"]["completion_tokens"]}


def load_run(
    url: str, questions: list[str], concurrency: int, n_requests: int, max_tokens: int, min_tokens: int = 0
) -> dict:
    jobs = iter(range(n_requests))
    lock = threading.Lock()
    latencies, statuses, tokens, ttfts = [], [], [], []

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            while True:
                with lock:
                    i = next(jobs, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/ask", json={"corpus": "handbook", "question": questions[i % len(questions)],
                                                "max_tokens": max_tokens, "min_tokens": min_tokens})
                    status = r.status_code
                except httpx.HTTPError:
                    status = -1
                dt = time.perf_counter() - t0
                with lock:
                    statuses.append(status)
                    if status == 200:
                        latencies.append(dt)
                        body = r.json()
                        tokens.append(body["usage"]["completion_tokens"])
                        ttfts.append(body["timings"]["ttft_ms"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency, "requests": n_requests, "wall_s": round(wall, 2),
        "requests_per_s": round(len(latencies) / wall, 3),
        "completion_tokens_per_s": round(sum(tokens) / wall, 2),
        "latency_p50_s": round(pct(latencies, "median"), 3), "latency_p95_s": round(pct(latencies, "p95"), 3),
        "server_ttft_p50_ms": round(pct(ttfts, "median"), 1),
        "errors": sum(1 for s in statuses if s != 200),
        "completion_tokens_min_max": [min(tokens, default=0), max(tokens, default=0)],
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--configs", default="16:0:16,16:0:1",
                    help="server configurations WORKERS:THREADS[:MAX_BATCH] (CAG_WORKERS, CAG_THREADS, CAG_MAX_BATCH; "
                         "threads 0 = the server's default)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="min_tokens of every load request (default: --max-tokens, i.e. answers of exactly that many tokens, so "
        "latency measures the server and not which answers happen to be short; 0: free length)",
    )
    ap.add_argument("--samples", type=int, default=4, help="hit / cold time-to-first-token samples")
    ap.add_argument("--home", help="CAG_HOME to use (default: a fresh temp dir)")
    ap.add_argument(
        "--replicas",
        help="e.g. 1,2: instead of the runs above, plain `cag serve` vs Ray Serve with that many replicas, two "
        "corpora, --replica-clients clients (bench/bench_replicas.py)",
    )
    ap.add_argument("--replica-clients", type=int, default=8, help="clients of the --replicas comparison")
    args = ap.parse_args()
    args.min_tokens = args.max_tokens if args.min_tokens is None else args.min_tokens
    if args.replicas:
        from .bench_replicas import run

        clients = args.replica_clients
        return run(
            [int(x) for x in args.replicas.split(",")], clients, max(args.requests, 6 * clients), args.max_tokens
        )

    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="cag-bench-api-"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "CAG_API_KEYS",
            "CAG_WORKERS",
            "CAG_MAX_QUEUE",
            "CAG_THREADS",
            "CAG_RESIDENT_BYTES",
            "CAG_HOME",
            "CAG_MAX_BATCH",
        )
    }
    env["CAG_HOME"] = str(home)
    env.setdefault("CAG_MODELS_DIR", str(get_settings().models_dir))  # the materialized model, not a new copy
    work = home / "bench"
    work.mkdir(parents=True, exist_ok=True)
    questions = [
        json.loads(line)["question"] for line in (HANDBOOK / "questions.jsonl").read_text().splitlines() if line
    ]

    print(f"ingest {HANDBOOK} (CAG_HOME={home})", file=sys.stderr)
    t0 = time.perf_counter()
    r = subprocess.run([*cag_command(), "ingest", str(HANDBOOK), "--json"], env=env, cwd=REPO, capture_output=True,
                       text=True, check=True)
    ingest = json.loads(r.stdout)
    ingest_wall = time.perf_counter() - t0
    partner = work / "partner"  # a second, small corpus whose questions evict the handbook's snapshot
    partner.mkdir(exist_ok=True)
    shutil.copy(HANDBOOK / "offices-and-hours.md", partner / "offices-and-hours.md")
    subprocess.run(
        [*cag_command(), "ingest", str(partner), "--json"], env=env, cwd=REPO, capture_output=True, check=True
    )

    results: dict = {
        "machine": machine(), "cpus": os.cpu_count(), "platform": platform.platform(),
        "corpus": {"name": "handbook", "n_tokens": ingest["n_tokens"], "n_documents": ingest["n_documents"],
                   "snapshot_bytes": ingest["bytes"], "ingest_wall_s": round(ingest_wall, 1),
                   "prefill_ms": ingest["prefill_ms"]},
        "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "runs": [], "loadavg_start": os.getloadavg(),
    }

    for config in args.configs.split(","):
        workers, threads, batch = ([int(x) for x in config.split(":")] + [16])[:3]
        print(f"serve with CAG_WORKERS={workers} CAG_THREADS={threads} CAG_MAX_BATCH={batch}", file=sys.stderr)
        with serving(
            dict(env, CAG_WORKERS=str(workers), CAG_THREADS=str(threads), CAG_MAX_QUEUE="64", CAG_MAX_BATCH=str(batch)),
            work / f"server-w{workers}-t{threads}-b{batch}.log",
            timeout_s=300,
            cwd=REPO,
        ) as srv:
            run: dict = {"workers": workers, "threads": threads, "max_batch": batch, "ready_s": round(srv.ready_s, 1),
                         "rss_after_start": proc_status(srv.proc.pid)["VmRSS"]}
            with httpx.Client(base_url=srv.url, timeout=600) as c:
                run["first_request"] = stream_ask(c, "handbook", questions[0], args.max_tokens)  # loads the snapshot
            run["load"] = []
            for conc in [int(x) for x in args.concurrency.split(",")]:
                n = max(args.requests, 3 * conc)
                print(f"  {conc} clients x {n} requests", file=sys.stderr)
                before = decode_counters(srv.url)
                level = load_run(srv.url, questions, conc, n, args.max_tokens, args.min_tokens)
                after = decode_counters(srv.url)
                steps = after[0] - before[0]
                level["mean_batch"] = round((after[1] - before[1]) / steps, 2) if steps else None
                level["peak_rss_bytes"] = proc_status(srv.proc.pid)["VmHWM"]
                run["load"].append(level)
            mem = proc_status(srv.proc.pid)
            run["peak_rss_bytes"], run["rss_bytes"] = mem["VmHWM"], mem["VmRSS"]
            run["metrics_excerpt"] = [line for line in httpx.get(f"{srv.url}/metrics").text.splitlines()
                                      if line.startswith(("cag_snapshot_hits_total", "cag_snapshot_loads_total",
                                                          "cag_resident_bytes", "cag_decode_"))]
            slot = [
                float(line.split()[-1]) for line in run["metrics_excerpt"] if line.startswith("cag_decode_slot_bytes ")
            ]
            results.setdefault("slot_mib", slot[0] / 2**20 if slot else 0.0)  # the server's own figure (its dtype)
        results["runs"].append(run)

    print("hit vs cold: CAG_RESIDENT_BYTES=1, a second corpus evicts the handbook between pairs", file=sys.stderr)
    # default workers and threads
    with serving(dict(env, CAG_RESIDENT_BYTES="1"), work / "server-cold.log", timeout_s=300, cwd=REPO) as srv:
        cold, hot = [], []
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            stream_ask(c, "handbook", questions[0], 2)  # the process's first question (warmup)
            for i in range(args.samples):  # side by side: evict, cold question, then the same question resident
                q = questions[1 + i % (len(questions) - 1)]
                stream_ask(c, "partner", "When does the office open?", 2)
                cold.append(stream_ask(c, "handbook", q, args.max_tokens))
                hot.append(stream_ask(c, "handbook", q, args.max_tokens))
        results["cold_loads"], results["resident_hits"] = cold, hot
    results["loadavg_end"] = os.getloadavg()

    hits = results["resident_hits"]
    results["ttft"] = {
        "resident_hit": {"client_ttft_ms_p50": round(statistics.median(s["client_ttft_ms"] for s in hits), 1),
                         "server_load_ms_p50": round(statistics.median(s["server_load_ms"] for s in hits), 2),
                         "server_ttft_ms_p50": round(statistics.median(s["server_ttft_ms"] for s in hits), 1)},
        "cold_load": {"client_ttft_ms_p50": round(statistics.median(s["client_ttft_ms"] for s in cold), 1),
                      "server_load_ms_p50": round(statistics.median(s["server_load_ms"] for s in cold), 2),
                      "server_ttft_ms_p50": round(statistics.median(s["server_ttft_ms"] for s in cold), 1)},
    }
    results["ttft"]["cold_over_hit"] = round(results["ttft"]["cold_load"]["client_ttft_ms_p50"]
                                             / results["ttft"]["resident_hit"]["client_ttft_ms_p50"], 2)
    write("api", results, markdown(results))
    if any(level["errors"] for run in results["runs"] for level in run["load"]):
        sys.exit("errors under load")


def _fmt_load(v) -> str:
    return "/".join(f"{x:.1f}" for x in v)


def markdown(res: dict) -> str:
    c = res["corpus"]
    lines = [
        "# API load benchmark (`bench/bench_api.py`)",
        "",
        f"Embedded SmolLM2-135M on corpora/handbook ({c['n_tokens']} tokens, {c['n_documents']} documents, snapshot "
        f"{c['snapshot_bytes'] / 2**20:.1f} MiB), `cag serve` on loopback, {res['machine']}, /v1/ask with "
        f"max_tokens={res['max_tokens']}, min_tokens={res.get('min_tokens', 0)} "
        f"({'answers of exactly that length' if res.get('min_tokens') == res['max_tokens'] else 'answers end at a stop token'}), "  # noqa: E501
        "greedy.",
        "",
        "| max batch | clients | requests | req/s | completion tok/s | vs 1 client | p50 latency s | p95 latency s | "
        "p95 / 1-client p50 | server TTFT p50 ms | mean decode batch | errors | peak RSS MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in res["runs"]:
        one = next((lv for lv in run["load"] if lv["concurrency"] == 1), run["load"][0])
        for lv in run["load"]:
            lines.append(
                f"| {run.get('max_batch', '-')} | {lv['concurrency']} | {lv['requests']} | {lv['requests_per_s']:.2f} "
                f"| {lv['completion_tokens_per_s']:.1f} | "
                f"{lv['completion_tokens_per_s'] / one['completion_tokens_per_s']:.2f}x | {lv['latency_p50_s']:.2f} | "
                f"{lv['latency_p95_s']:.2f} | {lv['latency_p95_s'] / one['latency_p50_s']:.2f}x | "
                f"{lv['server_ttft_p50_ms']:.0f} | {lv.get('mean_batch') or '-'} | {lv['errors']} | "
                f"{lv.get('peak_rss_bytes', run['peak_rss_bytes']) / 2**20:.0f} |"
            )
        lo, hi = run["load"][0], run["load"][-1]
        if hi["concurrency"] > lo["concurrency"] and "peak_rss_bytes" in hi:
            per = (hi["peak_rss_bytes"] - lo["peak_rss_bytes"]) / (hi["concurrency"] - lo["concurrency"]) / 2**20
            lines.append(f"| {run.get('max_batch', '-')} | peak RSS per extra client | | | | | | | | | | | {per:.1f} |")
    lines += [
        "",
        f"Workers {res['runs'][0]['workers']} (CAG_WORKERS); torch threads: the server's default. A suffix buffer "
        "(question + answer room, in the dtype the server attends in: /metrics cag_decode_slot_bytes) is "
        f"{res.get('slot_mib', 0):.2f} MiB per concurrent request; the snapshot, resident once, is "
        f"{res['corpus']['snapshot_bytes'] / 2**20:.1f} MiB on disk (float16 or bfloat16, CAG_KV_DTYPE; twice that in "
        "float32).",
    ]
    t = res["ttft"]
    hit, cold = t["resident_hit"], t["cold_load"]
    lines += [
        "",
        f"Time to first token, one client at a time, {len(res['cold_loads'])} side-by-side pairs (medians): "
        "a cold load reads and verifies the snapshot file and fills a fresh request buffer; a resident hit reuses "
        "both.",
        "",
        "| snapshot | client TTFT ms | server load ms | server TTFT ms |",
        "|---|---:|---:|---:|",
        f"| resident hit | {hit['client_ttft_ms_p50']:.0f} | {hit['server_load_ms_p50']:.2f} | "
        f"{hit['server_ttft_ms_p50']:.0f} |",
        f"| cold load (evicted) | {cold['client_ttft_ms_p50']:.0f} | {cold['server_load_ms_p50']:.2f} | "
        f"{cold['server_ttft_ms_p50']:.0f} |",
        "",
        f"Cold / hit client TTFT: {t['cold_over_hit']:.2f}x.",
        "",
        "Peak RSS is the server process's VmHWM (model weights fp32 + resident snapshots + request buffers).",
        f"Machine load average (1, 5, 15 min) at start {_fmt_load(res['loadavg_start'])}, at end "
        f"{_fmt_load(res['loadavg_end'])}: other work on these CPUs inflates latencies, so compare rows of one run.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
