"""`python -m bench.bench_api --replicas 1,2 [--replica-clients 8] [--max-tokens 16]`: plain `cag serve` vs `cag serve
--replicas N` on Ray Serve.

Two corpora (the handbook, and three of its documents as a second corpus) ingested into a shared S3
store (moto's server, in this process, on loopback); each server configuration is a real process
on its own fresh CAG_HOME that fetches the snapshots from the store. Per configuration: one warm-up
question per corpus, then `clients` clients (threads, their own connection each) send /v1/ask
requests, client i always on corpus i % 2: aggregate completion tokens/s, p50/p95 latency, errors,
and for Serve the routing hit rate (answers on a replica that already held the corpus, from the
replicas' own counters in /metrics). Writes bench/results/replicas.json and replicas.md.

Configurations on this 2-core machine, each with CAG_THREADS=1 (torch's thread count is per process:
one thread for the process's batched decode): plain (CAG_WORKERS=2), Serve with 1 replica of 2 CPUs (CAG_WORKERS=2),
Serve with 2 replicas of 1 CPU (CAG_WORKERS=1 each): 2 generations at once in all. Two replicas cannot scale on 2 cores;
the figure to read is Serve's overhead at 1 replica.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.harness import cag_command, serving
from cag.compare.metrics import summarize
from cag.config import get_settings

from .common import REPO, machine, write

HANDBOOK = REPO / "corpora" / "handbook"
STORE = "s3://cag-bench/replicas"


def replica_counters(url: str) -> dict[str, float]:
    """Sums over replicas of corpus loads and answers (Serve only)."""
    out = {"loads": 0.0, "answers": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        for key, name in (("loads", "cag_replica_corpus_loads_total{"), ("answers", "cag_replica_answers_total{")):
            if line.startswith(name):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def load(url: str, questions: list[str], clients: int, n_requests: int, max_tokens: int) -> dict:
    jobs, lock = iter(range(n_requests)), threading.Lock()
    latencies, tokens, statuses = [], [], []

    def client(i: int) -> None:
        corpus = ("handbook", "partner")[i % 2]
        with httpx.Client(base_url=url, timeout=600) as c:
            while (j := next(jobs, None)) is not None:
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/ask", json={"corpus": corpus, "question": questions[j % len(questions)],
                                                "max_tokens": max_tokens})
                    status = r.status_code
                except httpx.HTTPError:
                    status = -1
                with lock:
                    statuses.append(status)
                    if status == 200:
                        latencies.append(time.perf_counter() - t0)
                        tokens.append(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    p = summarize(latencies) if latencies else {"median": float("nan"), "p95": float("nan")}
    return {"clients": clients, "requests": n_requests, "wall_s": round(wall, 2),
            "completion_tokens_per_s": round(sum(tokens) / wall, 2), "latency_p50_s": round(p["median"], 3),
            "latency_p95_s": round(p["p95"], 3), "errors": sum(s != 200 for s in statuses)}


def run(replica_levels: list[int], clients: int, n_requests: int, max_tokens: int) -> None:
    from moto.server import ThreadedMotoServer

    from cag.store.remote import RemoteStore

    work = Path(tempfile.mkdtemp(prefix="cag-bench-replicas-"))
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    aws = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(aws)
    RemoteStore(STORE).ensure_bucket()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAG_")} | aws
    env |= {"CAG_STORE": STORE, "CAG_MODELS_DIR": os.environ.get("CAG_MODELS_DIR") or str(get_settings().models_dir),
            "CAG_THREADS": "1", "CAG_MAX_QUEUE": "64"}
    partner = work / "partner"
    partner.mkdir()
    for name in ("offices-and-hours.md", "expenses-and-travel.md", "leave-policy.md"):
        shutil.copy(HANDBOOK / name, partner / name)
    corpora = {}
    for folder in (HANDBOOK, partner):
        print(f"ingest {folder.name} into {STORE}", file=sys.stderr)
        r = subprocess.run(
            [*cag_command(), "ingest", str(folder), "--json"],
            env=env | {"CAG_HOME": str(work / "ingest")},
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        corpora[folder.name] = {k: json.loads(r.stdout)[k] for k in ("n_tokens", "bytes")}
    questions = [
        json.loads(line)["question"] for line in (HANDBOOK / "questions.jsonl").read_text().splitlines() if line
    ]

    configs = [("plain", 0, 2, 0)] + [(f"serve x{n}", n, 2 if n == 1 else 1, max(1, 2 // n)) for n in replica_levels]
    results = {"machine": machine(), "corpora": corpora, "clients": clients, "requests": n_requests,
               "max_tokens": max_tokens, "loadavg_start": os.getloadavg(), "runs": []}
    for label, replicas, workers, cpus in configs:
        args = ["--log-level", "warning"] + (
            ["--replicas", str(replicas), "--cpus-per-replica", str(cpus)] if replicas else []
        )
        print(f"{label}: CAG_WORKERS={workers} {' '.join(args)}", file=sys.stderr)
        home = work / f"home-{replicas}"
        with serving(env | {"CAG_HOME": str(home), "CAG_WORKERS": str(workers)}, work / f"server-{replicas}.log",
                     timeout_s=600, cwd=REPO, args=tuple(args)) as srv:
            with httpx.Client(base_url=srv.url, timeout=600) as c:  # warm-up: each corpus made resident once
                for corpus in ("handbook", "partner"):
                    c.post(
                        "/v1/ask", json={"corpus": corpus, "question": questions[0], "max_tokens": 2}
                    ).raise_for_status()
            before = replica_counters(srv.url) if replicas else None
            row = {
                "config": label,
                "replicas": replicas,
                "workers_per_replica": workers,
                "ready_s": round(srv.ready_s, 1),
                **load(srv.url, questions, clients, n_requests, max_tokens),
            }
            if replicas:
                after = replica_counters(srv.url)
                answers, loads = after["answers"] - before["answers"], after["loads"] - before["loads"]
                row |= {"corpus_loads_under_load": loads, "answers_on_replicas": answers,
                        "routing_hit_rate": round(1 - loads / answers, 3) if answers else None,
                        "corpus_loads_total": after["loads"]}
            results["runs"].append(row)
            print(f"  {row}", file=sys.stderr)
    results["loadavg_end"] = os.getloadavg()
    s3.stop()
    write("replicas", results, markdown(results))


def markdown(res: dict) -> str:
    plain = next(r for r in res["runs"] if r["replicas"] == 0)
    c = res["corpora"]
    lines = [
        "# Replicas on Ray Serve (`python -m bench.bench_api --replicas 1,2`)",
        "",
        f"{res['machine']}; corpora handbook ({c['handbook']['n_tokens']} tokens) and partner "
        f"({c['partner']['n_tokens']} tokens) from a moto S3 store on loopback; {res['clients']} clients, client i on "
        f"corpus i % 2, {res['requests']} /v1/ask requests, max_tokens={res['max_tokens']}, greedy, CAG_THREADS=1 (one "
        "torch thread per server or replica process), 2 generations at once in every configuration.",
        "",
        "| configuration | replicas x workers | completion tok/s | vs plain | p50 s | p95 s | errors | routing hit "
        "rate | corpus loads (total) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        ratio = (
            r["completion_tokens_per_s"] / plain["completion_tokens_per_s"]
            if plain["completion_tokens_per_s"]
            else float("nan")
        )
        hit = "-" if r.get("routing_hit_rate") is None else f"{r['routing_hit_rate']:.0%}"
        shape = "1 process" if not r["replicas"] else f"{r['replicas']} x {r['workers_per_replica']}"
        lines.append(
            f"| {r['config']} | {shape} | {r['completion_tokens_per_s']:.1f} | {ratio:.2f} | {r['latency_p50_s']:.2f} "
            f"| {r['latency_p95_s']:.2f} | {r['errors']} | {hit} | {r.get('corpus_loads_total', '-')} |"
        )
    load = "/".join(f"{x:.2f}" for x in res["loadavg_start"]), "/".join(f"{x:.2f}" for x in res["loadavg_end"])
    lines += ["", "Routing hit rate: answers during the load phase on a replica that already held the corpus "
              "(1 - corpus loads / answers, from the replicas' counters). Corpus loads (total) include the warm-up.",
              f"Load average (1/5/15 min) at start {load[0]}, at end {load[1]}.", ""]
    return "\n".join(lines)
