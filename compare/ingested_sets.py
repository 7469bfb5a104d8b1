"""The knowledge sets of a compare run made ready to ask: each written as files, its real prefix
measured against the context, ingested once per cag mode (sharded beyond the context, and per shard
size of the sweep), its RAG indexes and shard routers built before the first question. `SetInfo` is
what sets.json records of a set.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cag.errors import CagError, TooLarge
from cag.hashing import hash_obj, short
from cag.knowledge.shards import doc_of
from cag.model.prompt import build_prefix, document_text, encode_text

from .datasets import Corpus, Doc
from .knowledge_sets import KnowledgeSet
from .results import shard_cap
from .run_config import CompareConfig


@dataclass
class SetInfo:
    """One knowledge set as sets.json records it."""

    name: str
    size: int
    seed: int = 0
    corpus: str = ""
    folder: str = ""
    n_documents: int = 0
    doc_tokens: int = 0  # documents with their delimiters, as the pooling counted them
    prefix_tokens: int = 0  # the real knowledge prefix: template head + documents + template middle
    n_questions: int = 0
    skipped: str | None = None
    # One record per shard snapshot the set's `cag` corpus was ingested into (one when the set fits
    # the context): shard, status, prefill_ms, bytes, n_tokens, n_documents, snapshot.
    snapshots: list[dict] = field(default_factory=list)
    router_ms: float | None = None  # sharded: building the shard router (BM25 over the shards' text)
    skipped_modes: dict = field(default_factory=dict)  # mode -> why it is not asked on this set
    # shard-size sweep: cag@N -> {shard_tokens, corpus, snapshots, router_ms} or {shard_tokens, skipped}
    variants: dict = field(default_factory=dict)
    rag_index: dict = field(default_factory=dict)  # per retriever: build_ms, n_passages
    files: dict = field(default_factory=dict, repr=False)  # file name -> dataset doc id
    # per cag mode of a sharded corpus: the dataset doc ids in each shard, for routing recall
    shard_docs: dict = field(default_factory=dict, repr=False)

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("files", "shard_docs")}

    def corpus_of(self, mode: str) -> str:
        """The engine corpus a mode asks: a sweep's cag@N has its own, the others the set's."""
        return self.variants[mode]["corpus"] if mode in self.variants else self.corpus

    def runs(self, mode: str) -> bool:
        return mode not in self.skipped_modes


_UNSAFE = re.compile(r"[^\w.,()'+-]+")


def _slug(text: str) -> str:
    s = _UNSAFE.sub("_", text).strip("._")[:60]
    return s or "doc"


def file_names(docs: list[Doc]) -> list[str]:
    """One file name per document, numbered so the folder's (sorted) order is the set's order."""
    width = max(3, len(str(len(docs))))
    return [f"{i:0{width}d}-{_slug(d.title or d.doc_id)}.txt" for i, d in enumerate(docs)]


def cost_function(engine, corpus: Corpus) -> Callable[[str], int]:
    """Document text -> what it costs in the prompt, with its delimiters and file name."""
    tok = engine.lm.tokenizer
    title_of: dict[str, str] = {}
    for d in corpus.docs:
        title_of.setdefault(d.text, d.title or d.doc_id)
    width = max(3, len(str(len(corpus.docs))))

    @functools.cache
    def cost(text: str) -> int:
        name = f"{0:0{width}d}-{_slug(title_of.get(text, 'doc'))}.txt"
        return len(encode_text(tok, document_text(name, text)))

    return cost


def write_set(ks: KnowledgeSet, folder: Path) -> dict[str, str]:
    """The set's documents as files (rewritten only when different); file name -> dataset doc id."""
    folder.mkdir(parents=True, exist_ok=True)
    names = file_names(ks.docs)
    for old in folder.glob("*.txt"):
        if old.name not in names:
            old.unlink()  # a folder left by another run of the same name
    for name, d in zip(names, ks.docs):
        f = folder / name
        data = d.text.encode("utf-8")
        if not f.exists() or f.read_bytes() != data:
            f.write_bytes(data)
    return dict(zip(names, (d.doc_id for d in ks.docs)))


def fits_context(engine, prefix_tokens: int) -> bool:
    """Whether one snapshot (and one `full` prompt) of this prefix leaves room for a question and its
    answer. A set that does not fit is sharded for cag, and `full` is not asked on it."""
    return prefix_tokens + engine.room <= engine.lm.max_context


def prepare_set(engine, cfg: CompareConfig, ks: KnowledgeSet, size: int, corpora_root: Path,
             modes: list[str], reporter_factory, log) -> SetInfo:
    """Write, measure, ingest (once per cag mode) and index one set; a SetInfo with `skipped` set
    when it cannot be run at all, `skipped_modes` naming the modes it cannot run."""
    from cag.rag.index import index_for

    lm = engine.lm
    info = SetInfo(ks.name, size, ks.seed, n_documents=len(ks.docs), doc_tokens=ks.n_tokens,
                   n_questions=len(ks.questions))
    folder = (corpora_root / ks.name).resolve()
    info.folder = str(folder)
    info.corpus = f"compare-{ks.name}-{short(hash_obj(str(folder)), 6)}"
    if not ks.questions:
        info.skipped = "no question of the dataset is answerable from this set"
        log(f"{ks.name}: skipped ({info.skipped})")
        return info
    info.files = write_set(ks, folder)
    docs, _ = engine.read_corpus(folder, info.corpus)
    info.prefix_tokens = len(build_prefix(lm.tokenizer, engine.layout(), [(d.name, d.text) for d in docs]).ids)
    beyond = not fits_context(engine, info.prefix_tokens)
    if beyond and "full" in modes:
        info.skipped_modes["full"] = (f"prefix {info.prefix_tokens} tokens + {engine.room} for question and answer "
                                      f"> context {lm.max_context}: no single prompt holds the set")
    log(f"{ks.name}: {len(ks.docs)} documents, prefix {info.prefix_tokens} tokens"
        f"{' (beyond the context: sharded)' if beyond else ''}, {len(ks.questions)} questions; ingesting")
    try:  # shard_tokens 0: what fits (one snapshot when the set fits), never a cap left by an earlier run
        r = engine.ingest(str(folder), name=info.corpus, reporter=reporter_factory() if reporter_factory else None,
                          shard_tokens=0)
    except TooLarge as e:
        info.skipped = str(e)
        log(f"{ks.name}: skipped ({e})")
        return info
    info.snapshots = snapshot_records(engine, r)
    if r.n_shards > 1:
        info.router_ms, info.shard_docs["cag"] = shard_router(engine, info, info.corpus)
        log(f"{ks.name}: {r.n_shards} shards" + ("; full not asked (beyond the context)" if beyond else ""))
    for mode in modes:
        cap = shard_cap(mode)
        if not cap:
            continue
        corpus = f"{info.corpus}-cap{cap}"
        try:
            r = engine.ingest(str(folder), name=corpus, reporter=reporter_factory() if reporter_factory else None,
                              shard_tokens=cap)
        except CagError as e:  # e.g. a cap that leaves no room for knowledge: that variant only
            info.variants[mode] = {"shard_tokens": cap, "skipped": str(e)}
            info.skipped_modes[mode] = str(e)
            log(f"{ks.name} {mode}: skipped ({e})")
            continue
        variant = {"shard_tokens": cap, "corpus": corpus, "snapshots": snapshot_records(engine, r), "router_ms": None}
        if r.n_shards > 1:
            variant["router_ms"], info.shard_docs[mode] = shard_router(engine, info, corpus)
        info.variants[mode] = variant
        log(f"{ks.name} {mode}: {r.n_shards} shard{'s' if r.n_shards != 1 else ''}")
    for mode in modes:
        if mode.startswith("rag-") or mode == "cag+rag":
            kind, tokens = (
                (mode.split("-", 1)[1], None) if mode.startswith("rag-") else ("bm25", engine.settings.quote_tokens)
            )
            idx, _ = index_for(engine.lm, docs, kind, *([tokens] if tokens else []))
            info.rag_index[mode] = {"build_ms": round(idx.build_ms, 1), "n_passages": len(idx.passages),
                                    "passage_tokens": idx.passage_tokens}
    return info


def warm_quotes(engine, info: SetInfo, log) -> None:
    """Warm a set's cag+rag quotes (CAG_WARM_QUOTES, as `cag serve` does) once, just before its first question:
    a run of many sets would otherwise warm them all first and evict the early sets' quotes (CAG_QUOTE_BYTES)
    before their questions come."""
    index = info.rag_index.get("cag+rag")
    if index is None or "warmed" in index or not engine.settings.warm_quotes:
        return
    w = engine.warm_quotes(info.corpus)
    index["warmed"] = {"passages": w.passages, "tokens": w.tokens, "bytes": w.kept_bytes, "cold": w.cold,
                       "seconds": w.seconds, "reason": w.reason}
    why = f" ({w.reason})" if w.reason else ""
    log(f"{info.name}: {w.passages} cag+rag quotes warmed in {w.seconds:.1f} s{why}")


def snapshot_records(engine, r) -> list[dict]:
    """One record per shard of an ingest (`cag.results.IngestResult`); a snapshot built by an earlier
    run (status fresh) reports what building it cost then."""
    out = []
    for x in r.shards:
        prefill_ms = x["prefill_ms"]
        if x["status"] == "fresh":
            prefill_ms = (engine.index.snapshot(x["snapshot"]) or {}).get("prefill_ms") or 0.0
        out.append({"shard": x["shard"], "status": x["status"], "prefill_ms": round(prefill_ms, 1),
                    "bytes": x["bytes"], "n_tokens": x["n_tokens"], "n_documents": x["n_documents"],
                    "snapshot": x["snapshot"]})
    return out


def shard_router(engine, info: SetInfo, corpus: str) -> tuple[float, list[set[str]]]:
    """Build a sharded corpus's router before its first question (as RAG's index is built before
    its first), so no question's TTFT carries it: (build ms, the dataset doc ids of each shard).
    A shard's spans name its documents, or `name#partN` for a part of a long one."""
    from cag.answering.across_shards import route

    t0 = time.perf_counter()
    route(engine.index, engine.remote, engine.lm.tokenizer, corpus, "warm up the router", 1)
    build_ms = round((time.perf_counter() - t0) * 1e3, 1)
    shard_docs = []
    for row in engine.index.shards(corpus):
        names = {doc_of(s["path"]) for s in engine.index.snapshot_documents(row["snapshot"])}
        shard_docs.append({info.files.get(n, n) for n in names})
    return build_ms, shard_docs

