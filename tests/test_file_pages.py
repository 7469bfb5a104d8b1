"""Weights that are views of their checkpoint file (cag.model.file_pages): a bf16 checkpoint computed in
float32 loads as views of its file, keeps its fingerprint and its snapshots' bits, leaves the resident
set once packed, and a file rewritten under a loaded model is refused before a prefill reads it."""

import os
from pathlib import Path

import pytest
import torch

from cag.answering.query import Query
from cag.model import file_pages

pytestmark = pytest.mark.skipif(not file_pages.mappings(), reason="file mappings are read from Linux's /proc")


def _resident(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_release_drops_clean_file_pages_and_keeps_their_values(tmp_path):
    path = tmp_path / "w.bin"
    values = torch.randn(1 << 20)  # 4 MiB
    path.write_bytes(values.numpy().tobytes())
    view = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)  # a private file mapping
    assert file_pages.file_backed(view)
    assert torch.equal(view, values) and _resident(path) >= 4 << 20
    assert file_pages.release([view]) >= (4 << 20) - 2 * file_pages.PAGE
    assert _resident(path) < 64 << 10
    assert torch.equal(view, values)  # read again from the file: the same bytes


def test_release_never_touches_anonymous_or_written_memory(tmp_path):
    anon = torch.randn(1 << 20)
    keep = anon.clone()
    assert not file_pages.file_backed(anon)
    assert file_pages.release([anon]) == 0 and torch.equal(anon, keep)
    path = tmp_path / "w.bin"
    path.write_bytes(torch.zeros(1 << 20).numpy().tobytes())
    view = torch.from_file(str(path), shared=False, size=1 << 20, dtype=torch.float32)
    view[12345] = 7.0  # a page copied on write: the mapping is no longer the file's
    assert not file_pages.file_backed(view)
    assert file_pages.release([view]) == 0 and view[12345] == 7.0


def test_packing_a_file_view_by_blocks_releases_each_block_as_it_goes(tmp_path, monkeypatch):
    """Inside weights.apply (its file mappings set), a vocabulary-sized matrix viewing its file is packed
    block by block, each block's pages released once packed: the same copy as packing it in memory, and
    the matrix never resident whole beside it."""
    from cag.model import layouts

    values = (torch.randn(4096, 256) * 0.02).bfloat16()  # 2 MiB
    path = tmp_path / "w.bin"
    path.write_bytes(values.view(torch.uint8).numpy().tobytes())
    view = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.bfloat16).view(4096, 256)
    monkeypatch.setattr(layouts, "CHUNK", 512)  # 8 blocks
    seen, block = [], layouts.pack_q8.__wrapped__
    pack = layouts._by_rows(lambda w: (seen.append(_resident(path)), block(w))[1])  # pack_q8, noting what is resident
    token = layouts._file_maps.set(file_pages.mappings())
    try:
        packed = pack(view)
    finally:
        layouts._file_maps.reset(token)
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(packed, layouts.pack_q8(values)))
    assert max(seen) <= (256 << 10) + 2 * file_pages.PAGE  # a block (256 KiB) resident at a time, not 2 MiB
    assert _resident(path) < 64 << 10 and torch.equal(view, values)


def _bf16_checkpoint(tiny_model_dir, folder: Path) -> Path:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def test_a_bf16_checkpoint_loads_as_file_views_with_its_float32_fingerprint_and_snapshots(
    tiny_model_dir, small_corpus, tmp_path, monkeypatch
):
    """Computed in float32, a bf16 checkpoint is read as views of its file: the packed formats keep the
    layer matrices there (released once packed), fp32 widens them; the fingerprint is its float32
    load's, and the snapshots are fp32's bit for bit in every format (a float32 copy of the same values
    keys and prefills the same)."""
    import transformers

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.model.loading import weights_fingerprint
    from cag.store import snapshots

    folder = _bf16_checkpoint(tiny_model_dir, tmp_path / "bf16")
    wide = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_DTYPE", "float32")
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "torch")
    kv = {}
    for fmt in ("fp32", "int8", "int4"):
        monkeypatch.setenv("CAG_WEIGHTS", fmt)
        e = Engine(get_settings(home=tmp_path / fmt))
        assert e.lm.fingerprint == weights_fingerprint(wide), fmt
        layer = e.lm.model.model.layers[0]
        if fmt == "fp32":
            assert layer.mlp.down_proj.weight.dtype == torch.float32 and not file_pages.file_backed(
                layer.mlp.down_proj.weight
            )
        else:
            assert layer.mlp.down_proj.weight.dtype == layer.self_attn.q_proj.weight.dtype == torch.bfloat16
            assert file_pages.file_backed(layer.mlp.down_proj.weight) and file_pages.file_backed(
                layer.mlp.up_proj.weight
            )
            assert e.lm.model.model.embed_tokens.weight.dtype == e.lm.model.model.norm.weight.dtype == torch.float32
        e.ingest(str(small_corpus))
        kv[fmt] = snapshots.load(Path(e.index.snapshot(e.index.corpus("corpus")["current_snapshot"])["path"])).kv
        a = [
            e.answer(Query("corpus", "Who keeps the lighthouse?", mode=m, max_tokens=8)).token_ids
            for m in ("cag", "full")
        ]
        assert a[0] == a[1], fmt  # cag == full
    for fmt in ("int8", "int4"):
        assert all(torch.equal(a, b) for pa, pb in zip(kv["fp32"], kv[fmt]) for a, b in zip(pa, pb)), fmt


def test_a_weights_file_rewritten_under_a_loaded_model_is_refused_before_a_prefill(
    tiny_model_dir, small_corpus, tmp_path, monkeypatch
):
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.errors import ModelChanged

    folder = _bf16_checkpoint(tiny_model_dir, tmp_path / "bf16")
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_DTYPE", "float32")
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    e = Engine(get_settings(home=tmp_path / "home"))
    e.ingest(str(small_corpus))
    st = (folder / "model.safetensors").stat()
    # rewritten in place, as far as anyone can tell
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "a.md").write_text("The lighthouse keeper is Ada.")
    for refused in (
        lambda: e.ingest(str(tmp_path / "more")),
        lambda: e.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=4)),
    ):
        with pytest.raises(ModelChanged, match="changed on disk after it was loaded; restart"):
            refused()
    assert e.index.corpus("corpus")["current_snapshot"]  # what was stored stays


@pytest.mark.parametrize("kernels", ["avx512", "torch"])
def test_computed_in_bf16_a_bf16_checkpoint_stays_in_its_file_under_every_format(
    tiny64_model_dir, small_corpus, tmp_path, monkeypatch, kernels
):
    """Computed in bf16, the layer matrices of a bf16 checkpoint stay views of its file under the packed
    formats (no stack of them, no bf16 question copy beside int4's: a question's rows take the packed
    copy), and the snapshots are bit for bit the same in every format whose knowledge goes in blocks (a format
    prefilled as decode rows names itself in the key: another snapshot); cag == full in each."""
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.kernels import native
    from cag.model import layouts
    from cag.store import snapshots

    if kernels == "avx512" and (why := native.why_not()):
        pytest.skip(f"cag's kernels cannot run here: {why}")
    folder = _bf16_checkpoint(tiny64_model_dir, tmp_path / "bf16")
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_DTYPE", "bfloat16")
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    kv, digest, how = {}, {}, {}
    for fmt in ("fp32", "bf16", "int4") if layouts.bf16_packs() else ("fp32", "int4"):
        monkeypatch.setenv("CAG_WEIGHTS", fmt)
        e = Engine(get_settings(home=tmp_path / fmt))
        layer = e.lm.model.model.layers[0]
        matrices = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj]
        assert all(m.weight.dtype == torch.bfloat16 for m in matrices), fmt
        if fmt != "fp32":
            assert all(file_pages.file_backed(m.weight) for m in matrices), fmt
        if fmt == "int4":
            assert all(m.packs.questions is None and m.packs.nbytes < m.weight.nbytes for m in matrices)
        built = e.ingest(str(small_corpus))
        digest[fmt], how[fmt] = built.snapshot, e.prefill(built.n_tokens)
        kv[fmt] = snapshots.load(Path(e.index.snapshot(e.index.corpus("corpus")["current_snapshot"])["path"])).kv
        a = [
            e.answer(Query("corpus", "Who keeps the lighthouse?", mode=m, max_tokens=8)).token_ids
            for m in ("cag", "full")
        ]
        assert a[0] == a[1] and len(a[0]) > 1, fmt  # cag == full
    assert how["fp32"] == "blocks 16" and (how["int4"] == "rows int4-q8/avx512") == (kernels == "avx512")
    for fmt in set(kv) - {"fp32"}:
        if how[fmt].startswith("rows"):  # its own key: never served for another format
            assert digest[fmt] != digest["fp32"], fmt
            continue
        assert all(torch.equal(a, b) for pa, pb in zip(kv["fp32"], kv[fmt]) for a, b in zip(pa, pb)), fmt
