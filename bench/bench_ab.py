"""Before and after: one probe run in two checkouts of cag, interleaved, in one run.

A change of arithmetic (a rule such as "a row's K/V never depend on how rows were grouped") has a cost
that only the same measurement on the old and the new code, on the same machine at the same time, can
show. `--before REV` checks REV out into a temporary git worktree; each round runs the probe (below)
once in it and once in this checkout, each a fresh process (its own model load), alternating which goes
first; each figure is reported as the best over the rounds.

The probe (bench/ab_probe.py, run with each tree's cag) uses the engine's public API only:
  * knowledge prefill: `ingest` of a ~4K-token essay corpus (tok/s);
  * TTFT of distinct plain questions over the snapshot (ms, mean of --questions);
  * decode tok/s of a 64-token answer;
  * a conversation of 6 turns, 48-token answers sent back as a client does: TTFT of turn 1 and turn 6;
  * TTFT of a short question alone, and asked while a 2,000-token conversation is being prefilled.

    python -m bench.bench_ab --before 23a3212 --rounds 2

Writes bench/results/ab-<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, machine, write


def _run(tree: Path, args) -> dict:
    """The probe in a fresh process that imports cag (and bench.common) from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("CAG_DATASETS", str(REPO.parent / "shared" / "datasets"))  # a worktree has no shared/ beside it
    cmd = [sys.executable, str(REPO / "bench" / "ab_probe.py"), str(args.corpus_tokens), str(args.questions)]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(
            f"probe failed in {tree}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}"
        )
    return json.loads(p.stdout.strip().splitlines()[-1])


def worktree(rev: str) -> Path:
    """REV checked out in a temporary git worktree, importable as `cag` from its root: the folders
    pyproject.toml maps into the package (cag.store = store/, ...) linked inside its cag/."""
    tree = Path(tempfile.mkdtemp(prefix="cag-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True, capture_output=True)
    for sub in ("store", "api", "cli", "rag", "compare"):
        if (tree / sub).is_dir() and not (tree / "cag" / sub).exists():
            (tree / "cag" / sub).symlink_to(tree / sub)
    return tree


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--corpus-tokens", type=int, default=4000)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--name", default="rule")
    args = ap.parse_args(argv)
    old = worktree(args.before)
    try:
        runs = {"before": [], "after": []}
        for i in range(args.rounds):
            order = [("before", old), ("after", REPO)] if i % 2 == 0 else [("after", REPO), ("before", old)]
            for name, tree in order:
                t0 = time.perf_counter()
                runs[name].append(_run(tree, args))
                print(name, runs[name][-1], f"{time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    higher = {"prefill_tok_s", "decode_tok_s"}
    best = {name: {k: (max if k in higher else min)(r[k] for r in rs if r[k] is not None)
                   for k in rs[0] if isinstance(rs[0][k], (int, float)) and k != "tokens"} for name, rs in runs.items()}
    result = {
        "machine": machine(),
        "before": args.before,
        "after": _head(),
        "rounds": args.rounds,
        "runs": runs,
        "best": best,
        "resolved": {k: f"{runs[k][0]['weights']}/{runs[k][0]['kernels']}" for k in runs},
    }
    rows = [f"| {k} | {best['before'][k]} | {best['after'][k]} | {best['after'][k] / best['before'][k]:.2f} |"
            for k in best["before"] if best["before"][k]]
    settings = " ".join(
        f"{k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith("CAG_") and k not in ("CAG_MODELS_DIR", "CAG_DATASETS")
    )
    result["settings"] = settings
    table = "\n".join([f"# Before ({args.before}) and after ({result['after']})", "",
                       f"Machine: {result['machine']}. Weights/kernels {result['resolved']['after']}; "
                       f"{runs['after'][0]['tokens']}-token essay corpus; best of {args.rounds} interleaved rounds. "
                       f"Command: `{settings + ' ' if settings else ''}python -m bench.bench_ab --before {args.before} "
                       f"--rounds {args.rounds} --name {args.name}`.", "",
                       "| figure | before | after | after / before |", "|---|---:|---:|---:|", *rows, ""])
    write(f"ab-{args.name}", result, table)


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    main()
