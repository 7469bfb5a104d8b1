"""Shared store benchmark: a snapshot fetched from an S3 server into the local cache (download,
full verification, rename) against the raw download of the same object, and int8 against fp16
snapshots (bytes, load time), at 2K/4K/7K tokens of SmolLM2-135M's KV shape.

The S3 server is moto's (`python -m moto.server`) in its own process on loopback, so server and
client do not share an interpreter; both numbers go through the same downloader (s3fs
get_file), so their ratio is what the cache adds: verification (checksum over every tensor,
shapes, key) and the rename. Median of 5, fetch and raw alternating.

    python -m bench.bench_store [--sizes 2000,4000,7000]
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import machine, write

SIZES = (2000, 4000, 7000)
REPEAT = 5
URL = "s3://bench/store"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def _median(fn, repeat: int = REPEAT) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prefix sizes in tokens, comma-separated")
    ap.add_argument("--out", default="store", help="results name under bench/results")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    proc, endpoint = _server()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", CAG_STORE=URL)
    try:
        rows = _bench(sizes)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [
        "| prefix tokens | dtype | bytes | int8/fp16 | load (parse, verify, dequantize) | fetch into cache | raw "
        "download | raw/fetch | fetch MB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n_tokens']:,} | {r['dtype']} | {r['bytes'] / 1e6:.1f} MB | {r['bytes_vs_fp16']:.3f} | "
            f"{r['load_ms']:.1f} ms | {r['fetch_ms']:.1f} ms | {r['raw_ms']:.1f} ms | **{r['raw_over_fetch']:.2f}** | "
            f"{r['bytes'] / r['fetch_ms'] / 1e3:.0f} |"
        )
    table = "\n".join(lines) + f"\n\n{machine()}; moto server in its own process on loopback; median of {REPEAT}\n"
    print(table)
    write(args.out, {"machine": machine(), "repeat": REPEAT, "rows": rows}, table)


def _bench(sizes: list[int]) -> list[dict]:
    """Snapshots of SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64) filled with
    random values: what is timed (bytes over the wire, verification, dequantizing) does not depend
    on the values, and no prefill competes with other work on the machine."""
    import torch

    from cag.config import get_settings
    from cag.hashing import hash_obj, short
    from cag.store import snapshots as snapfiles
    from cag.store.remote import RemoteStore
    from cag.store.sync import Shared

    RemoteStore(URL).ensure_bucket()
    rows = []
    layers, heads, head_dim = 30, 3, 64
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        settings = get_settings(home=tmp / "b")
        from cag.store.index import Index

        b = Shared(settings, Index(settings.index_path))
        g = torch.Generator().manual_seed(0)
        for n in sizes:
            kv = [(torch.randn(1, heads, n, head_dim, generator=g), torch.randn(1, heads, n, head_dim, generator=g))
                  for _ in range(layers)]
            ids = list(range(n))
            fp16_bytes = None
            for dtype in ("float16", "int8"):
                key = hash_obj({"bench": "store", "n": n, "dtype": dtype})
                digest = short(key, 32)
                local = tmp / "a" / f"{digest}.safetensors"
                snapfiles.save(
                    local, kv, ids, {"key": key, "corpus": f"bench-{n}", "spans": []}, snapfiles.DTYPES[dtype]
                )
                b.remote.put_blob(local, digest)
                fp16_bytes = fp16_bytes or local.stat().st_size
                cached = settings.snapshots_dir / f"{digest}.safetensors"
                raw_to = tmp / "raw.bin"

                def fetch():
                    cached.unlink(missing_ok=True)
                    b.ensure_local(digest, cached)

                def raw():
                    b.remote.get_blob(digest, raw_to)
                    raw_to.unlink()

                fetch_t, raw_t = [], []
                for _ in range(REPEAT):  # alternating, so drift on a shared machine hits both
                    fetch_t.append(_median(fetch, 1))
                    raw_t.append(_median(raw, 1))
                load = _median(lambda: snapfiles.load(local))
                f, r = statistics.median(fetch_t), statistics.median(raw_t)
                rows.append({"n_tokens": n, "dtype": dtype, "bytes": local.stat().st_size,
                             "bytes_vs_fp16": local.stat().st_size / fp16_bytes, "load_ms": load * 1e3,
                             "fetch_ms": f * 1e3, "raw_ms": r * 1e3, "raw_over_fetch": r / f})
                print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
