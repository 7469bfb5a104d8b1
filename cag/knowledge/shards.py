"""Knowledge larger than one context: documents packed into shards, each prefilled into its own
snapshot.

A shard's prompt is the same layout as an unsharded corpus's (head | documents | mid), so a corpus
that fits one context is one shard with exactly today's prefix and key. Documents are the units of
packing; a document that alone does not fit a shard is cut into parts (paragraphs, then sentences,
then, as the last resort, token windows), each named `name#partN` and wrapped like a document.

A first build packs the units by first fit in prompt order, unless even loads (largest unit first, each to the least
loaded shard: `_balanced`) need fewer shards or leave the smallest one fuller; each shard keeps its units in prompt
order. Even loads matter: a question's speedup over prefilling its shard from scratch shrinks with the shard (the
prefill grows with the square of its length, the question's own pass does not), and the sum of the shards' prefill costs
is least when they are even. Assignment is sticky so that an edit re-prefills one shard: units keep the shard they were
in (read from the previous snapshots' spans) while it still fits; new units fill the last shard, then open new ones.
Only when a shard no longer fits are it and the shards after it packed afresh. Token counts add up exactly because each
unit is tokenized on its own (cag/model/prompt.py).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

from cag.model.prompt import document_text, encode_text

PART = "#part"


@dataclass
class Unit:
    name: str  # the document's name, or `name#partN` for a part of a long document
    doc: str  # the document it comes from (its file, for freshness)
    text: str
    content_hash: str
    n_tokens: int  # tokens of the unit wrapped as a document
    cut_by_tokens: bool = False  # no sentence boundary was short enough: cut mid-sentence
    ids: list[int] | None = field(default=None, repr=False, compare=False)  # those tokens, when already made


@dataclass
class ShardPlan:
    units: list[Unit] = field(default_factory=list)

    def tokens(self, overhead: int) -> int:
        return overhead + sum(u.n_tokens for u in self.units)


def doc_of(unit_name: str) -> str:
    """The document a unit (or a snapshot span) belongs to: `a.md#part2` -> `a.md`."""
    head, sep, tail = unit_name.rpartition(PART)
    return head if sep and tail.isdigit() else unit_name


def units_of(tokenizer, docs, capacity: int, progress=None) -> list[Unit]:
    """Documents as packing units: whole when one fits `capacity` tokens, else cut into parts. Each
    unit keeps its token ids (the prompt layout's, `encode_text`), so no document is tokenized twice.
    `progress(n)`: n more characters of the documents tokenized."""
    units = []
    for d in docs:
        ids = encode_text(tokenizer, document_text(d.name, d.text), progress)
        if len(ids) <= capacity:
            units.append(Unit(d.name, d.name, d.text, d.content_hash, len(ids), ids=ids))
            continue
        del ids
        for i, (text, by_tokens) in enumerate(_cut(tokenizer, d.name, d.text, capacity), start=1):
            name = f"{d.name}{PART}{i}"
            part = encode_text(tokenizer, document_text(name, text))
            units.append(Unit(name, d.name, text, d.content_hash, len(part), by_tokens, ids=part))
    return units


JOIN = "\n\n"  # between the pieces of a part
SLACK = 4  # tokens a join may add beyond the pieces' own counts (pre-tokenizers re-split whitespace there)


def _cut(tokenizer, name: str, text: str, capacity: int) -> list[tuple[str, bool]]:
    """Parts of `text` that each fit `capacity` tokens once wrapped: paragraphs, else sentences,
    else token windows. Returns (part text, cut mid-sentence).

    Each piece is tokenized once; a part grows by the pieces' counts (plus what a join may add) and
    is tokenized whole only when that bound reaches its room, so cutting a long document costs a few
    passes over it, not one per piece. The parts are those of growing one piece at a time while the
    whole part fits (what an exact count each time gives), and each part is checked once at the end."""
    wrap = len(encode_text(tokenizer, document_text(f"{name}{PART}9999", ""))) + 2  # name, tags, newlines
    room = max(1, capacity - wrap)
    count = lambda s: len(encode_text(tokenizer, s))  # noqa: E731
    pieces: list[tuple[str, bool, int]] = []
    for para in re.split(r"\n\s*\n", text):
        if not para.strip():
            continue
        if (n := count(para)) <= room:
            pieces.append((para, False, n))
            continue
        for sent in re.split(r"(?<=[.!?])\s+", para):
            if (n := count(sent)) <= room:
                pieces.append((sent, False, n))
                continue
            ids = encode_text(tokenizer, sent)
            pieces += [
                (w, True, count(w)) for w in (tokenizer.decode(ids[i : i + room]) for i in range(0, len(ids), room))
            ]
    join = count(JOIN) + SLACK
    parts: list[tuple[str, bool]] = []
    bound = 0  # at least the current part's tokens
    for piece, by_tokens, n in pieces:  # greedy: as many pieces per part as fit
        if parts and bound + join + n <= room:  # fits whatever the join does
            parts[-1], bound = (parts[-1][0] + JOIN + piece, parts[-1][1] or by_tokens), bound + join + n
        elif parts and (exact := count(parts[-1][0] + JOIN + piece)) <= room:
            parts[-1], bound = (parts[-1][0] + JOIN + piece, parts[-1][1] or by_tokens), exact
        else:
            parts.append((piece, by_tokens))
            bound = n
    checked = []
    for part, by_tokens in parts:  # a tokenizer whose joins add more than SLACK: cut that part finer
        checked += [(part, by_tokens)] if count(part) <= room else _exactly(part.split(JOIN), by_tokens, room, count)
    return checked


def _exactly(pieces: list[str], by_tokens: bool, room: int, count) -> list[tuple[str, bool]]:
    parts: list[tuple[str, bool]] = []
    for piece in pieces:
        if parts and count(parts[-1][0] + JOIN + piece) <= room:
            parts[-1] = (parts[-1][0] + JOIN + piece, by_tokens)
        else:
            parts.append((piece, by_tokens))
    return parts


def pack(units: list[Unit], capacity: int, overhead: int, previous: list[list[str]] | None = None) -> list[ShardPlan]:
    """Units into shards of at most `capacity` prompt tokens (`overhead` = head + mid tokens).
    `previous`: unit names per shard of the last build, to keep units where they were."""
    by_name = {u.name: u for u in units}
    shards: list[ShardPlan] = []
    placed: set[str] = set()
    for names in previous or []:
        shard = ShardPlan([by_name[n] for n in names if n in by_name and n not in placed])
        if not shard.units:
            continue
        if shard.tokens(overhead) > capacity:
            break  # this shard grew past the limit: it and what follows are packed afresh
        shards.append(shard)
        placed.update(u.name for u in shard.units)
    # A first build: first fit (a unit that does not fit the newest shard may still fill an older one:
    # on the 49 essays, 23 shards of at least 3.8K tokens instead of 28 down to 0.6K when each shard
    # is only filled in turn), then even loads in as many shards or fewer (_balanced). A rebuild fills
    # only the last shard, then new ones, so that the shards after one that outgrew its limit tend to
    # come out as they were (snapshots reused).
    first_fit = not previous
    for u in units:
        if u.name in placed:
            continue
        candidates = shards if first_fit else shards[-1:]
        home = next((s for s in candidates if s.tokens(overhead) + u.n_tokens <= capacity), None)
        if home is None:
            home = ShardPlan()
            shards.append(home)
        home.units.append(u)
        placed.add(u.name)
    if first_fit and len(shards) > 1 and (even := _balanced(units, capacity - overhead, len(shards))):
        smallest = lambda plan: min(p.tokens(0) for p in plan)  # noqa: E731
        if (len(even), -smallest(even)) < (len(shards), -smallest(shards)):  # fewer shards, or a fuller smallest
            return even
    return shards


def _balanced(units: list[Unit], room: int, most: int) -> list[ShardPlan] | None:
    """`units` into the fewest shards (at most `most`) of at most `room` unit tokens that the
    largest-first rule fills: each unit, largest first, to the least loaded shard (if that one cannot
    take it, none can). Shards keep prompt order inside and are ordered by their first unit. None when
    no count up to `most` works."""
    order = sorted(range(len(units)), key=lambda i: (-units[i].n_tokens, i))
    for k in range(max(1, -(-sum(u.n_tokens for u in units) // room)), most + 1):
        loads = [(0, j) for j in range(k)]  # a heap of (tokens, shard)
        bins: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            load, j = heapq.heappop(loads)
            if load + units[i].n_tokens > room:
                break
            bins[j].append(i)
            heapq.heappush(loads, (load + units[i].n_tokens, j))
        else:
            return [ShardPlan([units[i] for i in sorted(b)]) for b in sorted((b for b in bins if b), key=min)]
    return None


_OWNERS: dict[tuple, dict[str, int]] = {}  # (shard, snapshot) pairs -> owners(): a snapshot's documents never change


def owners(index, corpus: str) -> dict[str, int]:
    """Document name -> the shard holding it (its first part's, for a document cut across shards); {} unsharded.
    Read from the index once per set of shard snapshots (every cag+rag question on a sharded corpus asks)."""
    rows = index.shards(corpus)
    if len(rows) < 2:
        return {}
    key = tuple((r["shard"], r["snapshot"]) for r in rows)
    if (out := _OWNERS.get(key)) is None:
        out = {}
        for r in rows:
            for span in index.snapshot_documents(r["snapshot"]):
                out.setdefault(doc_of(span["path"]), r["shard"])
        if len(_OWNERS) >= 64:  # a long-lived server's refreshed corpora: the oldest sets go
            _OWNERS.pop(next(iter(_OWNERS)))
        _OWNERS[key] = out
    return out
