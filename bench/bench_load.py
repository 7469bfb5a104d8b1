"""What a command costs before it answers: a model load with and without the packed weights kept on
disk (CAG_KEEP_PACKED), and `cag list` / `cag status` / `cag info` against a load's own status, side by
side in one run.

Each figure is a fresh process (its own imports), rounds interleaving the variants, best and median
reported:
  * `load, packing`:     load_model with keep_packed=False (every matrix packed from the weights);
  * `load, kept packed`: load_model reading the file a previous load kept (cag.model.packed_cache);
  * `cag list` etc.:     the command's wall time, reading the facts a load recorded (no model load);
  * `status by loading`: a process that loads the model to say the same (what `cag list` did before).
Models: the embedded SmolLM2-135M (int4 with cag's kernels where they run, as `auto` picks) and,
with --shapes, random-weight shapes from bench/bench_models.py (e.g. qwen2.5-0.5b).

    python -m bench.bench_load [--rounds 3] [--shapes qwen2.5-0.5b]

Writes bench/results/load.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, machine, write

LOAD = """
import json, sys, time
t = time.perf_counter()
from pathlib import Path
from cag.config import get_settings
from cag.model.loading import load_model
s = get_settings()
t1 = time.perf_counter()
lm = load_model(s.model, s.models_dir, s.threads, s.dtype, s.weights, s.device, s.decode_kernels, {keep})
print(json.dumps({{"imports_s": t1 - t, "load_s": time.perf_counter() - t1, "weights": lm.weights, "kernels": lm.kernels}}))
"""  # noqa: E501

STATUS_BY_LOADING = """
from cag.config import get_settings
from cag.engine import Engine
e = Engine(get_settings())
e.lm
print([s.stale for s in e.list()])
"""


def _env(home: Path, model: str, models: Path) -> dict:
    return dict(os.environ, CAG_HOME=str(home), CAG_MODEL=model, CAG_MODELS_DIR=str(models), PYTHONPATH=str(REPO))


def _timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed: {p.stderr[-2000:]}")
    return time.perf_counter() - t, p.stdout


def one_model(model: str, models: Path, rounds: int, work: Path) -> dict:
    home = work / f"home-{abs(hash(model))}"
    env = _env(home, model, models)
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "note.md").write_text("The office opens at nine. The keeper of the lighthouse is Mara Voss.\n")
    cag = [sys.executable, "-m", "cag"]
    _timed([*cag, "ingest", str(corpus), "--name", "notes"], env)  # loads once: records the facts, keeps the packing
    runs: dict[str, list[float]] = {
        k: []
        for k in ("load, packing", "load, kept packed", "cag list", "cag status notes", "cag info", "status by loading")
    }
    facts = {}
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for keep in order:
            _, out = _timed([sys.executable, "-c", LOAD.format(keep=keep)], env)
            d = json.loads(out.strip().splitlines()[-1])
            runs["load, kept packed" if keep else "load, packing"].append(d["load_s"])
            facts = {"weights": d["weights"], "kernels": d["kernels"]}
        for name, args in (("cag list", ["list"]), ("cag status notes", ["status", "notes"]), ("cag info", ["info"])):
            runs[name].append(_timed([*cag, *args], env)[0])
        runs["status by loading"].append(_timed([sys.executable, "-c", STATUS_BY_LOADING], env)[0])
    return {"model": model, **facts, "rounds": rounds,
            "seconds": {k: {"best": min(v), "median": statistics.median(v)} for k, v in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="", help="comma-separated shapes of bench/bench_models.py to load too")
    ap.add_argument("--work", default=None, help="folder for built models (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="cag-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    models = Path(os.environ.get("CAG_MODELS_DIR") or work / "models")
    from cag.config import DEFAULT_MODEL

    todo = [DEFAULT_MODEL]
    if args.shapes:
        from .bench_models import build

        todo += [str(build(s, work)) for s in args.shapes.split(",") if s]
    rows = [one_model(m, models, args.rounds, work) for m in todo]
    lines = [
        f"# Load and instant commands ({machine()})",
        "",
        f"Fresh process per figure, {args.rounds} rounds interleaved; seconds, best / median.",
        "",
        "| model | weights, kernels | load, packing | load, kept packed | cag list | cag status | cag info | status by "
        "loading |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        cell = lambda k: f"{s[k]['best']:.2f} / {s[k]['median']:.2f}"  # noqa: E731
        lines.append(
            f"| {Path(r['model']).name} | {r['weights']}, {r['kernels']} | {cell('load, packing')} | "
            f"{cell('load, kept packed')} | {cell('cag list')} | {cell('cag status notes')} | {cell('cag info')} | "
            f"{cell('status by loading')} |"
        )
    write("load", {"machine": machine(), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
