"""report.md's knowledge-set table: each set's documents, real prefix, questions and one-time cost
(cag prefill, snapshot size, shards and their router, RAG indexes), the shard-size sweep's ingests,
and the sizes that hold fewer questions than asked.
"""

from __future__ import annotations

from cag.results import human_bytes

from .results import ready_sets, set_snapshots, shard_cap, shards_text


def _reused(snaps: list[dict]) -> str:
    """" (reused)" when every snapshot existed already, " (2 of 9 shards reused)" when some did."""
    n = sum(x.get("status") == "fresh" for x in snaps)
    if not n:
        return ""
    return " (reused)" if n == len(snaps) else f" ({n} of {len(snaps)} shards reused)"


def sets_table(sets: list[dict], asked: int | None) -> list[str]:
    L = ["## Knowledge sets", "",
         "| size | set | documents | document tokens | real prefix | questions | cag prefill | snapshot "
         "| cag shards | rag index |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in sets:
        if s.get("skipped"):
            L += [f"| {s['size']} | {s['name']} | {s.get('n_documents') or '–'} | {s.get('doc_tokens') or '–'} "
                  f"| {s.get('prefix_tokens') or '–'} | – | skipped: {s['skipped']} | | | |"]
            continue
        snaps = set_snapshots(s)
        prefill = sum(x.get("prefill_ms") or 0 for x in snaps)
        reused = _reused(snaps)
        size_b = sum(x.get("bytes") or 0 for x in snaps)
        snap = (human_bytes(size_b) + (f" in {len(snaps)} snapshots" if len(snaps) > 1 else "")) if snaps else "–"
        rag = "; ".join(f"{m} {v['build_ms']:.0f} ms, {v['n_passages']} passages" + _warmed(v.get("warmed"))
                        for m, v in (s.get("rag_index") or {}).items()) or "–"
        shards = shards_text(snaps)
        if len(snaps) > 1 and s.get("router_ms") is not None:
            shards += f"; router {s['router_ms']:.0f} ms"
        for mode, why in (s.get("skipped_modes") or {}).items():
            if shard_cap(mode) is None:  # a sweep variant's skip is in the sweep's table
                shards += f"; {mode} not asked: {why}"
        L += [f"| {s['size']} | {s['name']} | {s['n_documents']} | {s['doc_tokens']:,} | {s['prefix_tokens']:,} "
              f"| {s['n_questions']} | {prefill / 1e3:.1f} s{reused} | {snap} | {shards} "
              f"| {rag} |"]
    L += ["", "Real prefix = the tokens of the knowledge prefix the engine builds (chat template head, documents "
          "with their delimiters, template middle); sets of one nominal size differ. cag prefill and snapshot "
          "are the one-time cost of each set ((reused) = a snapshot with the same key existed already, e.g. from "
          "an earlier run or an identical shard, its build time shown); cag "
          "shards: 1 when the set fits the context, else the shards (tokens each) and the time to build their "
          "router."]
    variants = [(s, m, v) for s in ready_sets(sets) for m, v in (s.get("variants") or {}).items()]
    if variants:
        L += ["", "Shard-size sweep ingests (the same sets, shards of at most N tokens):", "",
              "| size | set | mode | shards | prefill | snapshots |", "|---:|---|---|---|---:|---:|"]
        for s, m, v in variants:
            if v.get("skipped"):
                L += [f"| {s['size']} | {s['name']} | {m} | skipped: {v['skipped']} | | |"]
                continue
            snaps = v.get("snapshots") or []
            prefill = sum(x.get("prefill_ms") or 0 for x in snaps)
            reused = _reused(snaps)
            L += [f"| {s['size']} | {s['name']} | {m} | {shards_text(snaps)} "
                  f"| {prefill / 1e3:.1f} s{reused} "
                  f"| {human_bytes(sum(x.get('bytes') or 0 for x in snaps))} |"]
    if asked:
        for size in dict.fromkeys(s["size"] for s in sets):
            got = sum(s["n_questions"] for s in ready_sets(sets) if s["size"] == size)
            n_sets = len([s for s in ready_sets(sets) if s["size"] == size])
            if got < asked:
                L += ["", f"**Size {size}: {got} of the {asked} questions asked** "
                          f"({n_sets} set{'s' if n_sets != 1 else ''} pooled)."]
    return L + [""]


def _warmed(w: dict | None) -> str:
    """cag+rag's quotes warmed before the questions (CAG_WARM_QUOTES), and what it cost."""
    if not w:
        return ""
    cold = f", {w['cold']} cold" if w.get("cold") else ""
    size = human_bytes(w["bytes"])
    return f" (quotes warmed: {w['passages']}, {w['tokens']:,} tokens, {w['seconds']:.1f} s, {size}{cold})"
