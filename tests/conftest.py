"""Shared fixtures.

Tier 1: a tiny random LlamaForCausalLM (2 layers, GQA 4:2) with a byte-level BPE tokenizer trained
in-process, saved as a normal Hugging Face folder, so it loads through the same `--model PATH`
code as any user model. Tier 2 (`real` marker): the embedded SmolLM2-135M, materialized once per
test session into a shared models folder.

Every test runs with CAG_HOME in its own temp dir (no test writes to a real home), and with no
CAG_* variable from the developer's shell but those in FROM_SHELL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HANDBOOK = REPO / "corpora" / "handbook"
DATASETS = Path(os.environ.get("CAG_DATASETS", REPO.parent / "shared" / "datasets"))

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte encodes: no unknown tokens
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML,
    )


def _tiny(tmp_path_factory, name: str, hidden: int, heads: int, kv_heads: int, init: float) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [p.read_text() for p in sorted(HANDBOOK.glob("*.md"))] + ["What is the answer? The answer is 42."]
    tok = _train_tokenizer(texts)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        initializer_range=init,  # larger than default so a random model gives varied, input-dependent tokens
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random chat model saved as a Hugging Face folder (~1 MB), built in a second."""
    return _tiny(tmp_path_factory, "tiny-model", hidden=64, heads=4, kv_heads=2, init=0.3)


@pytest.fixture(scope="session")
def tiny64_model_dir(tmp_path_factory) -> Path:
    """The tiny model with heads of 64 (SmolLM2's), the width cag.kernels.native's decode attention takes."""
    return _tiny(tmp_path_factory, "tiny64-model", hidden=256, heads=4, kv_heads=2, init=0.15)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Where the embedded model is materialized once for the whole session (CAG_MODELS_DIR)."""
    shared = os.environ.get("CAG_TEST_MODELS_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("models")


# The only CAG_* variables the suite takes from the developer's shell, on purpose: where the shared
# datasets are (read at import above, and by cag.compare) and a models folder shared across runs.
FROM_SHELL = frozenset({"CAG_DATASETS", "CAG_TEST_MODELS_DIR"})
PREFILL_BLOCK = 16  # tier 1's knowledge-prefill block (CAG_PREFILL_BLOCK): the small corpora span several blocks


def _clear_shell_settings(mp: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("CAG_") and v not in FROM_SHELL]:
        mp.delenv(var)  # a setting (or test hook) left in the shell would leak into the suite


@pytest.fixture(scope="session", autouse=True)
def no_shell_settings():
    """Cleared for the whole session too: module-scoped fixtures (servers) start before `cag_home`."""
    with pytest.MonkeyPatch.context() as mp:
        _clear_shell_settings(mp)
        mp.setenv("CAG_PREFILL_BLOCK", str(PREFILL_BLOCK))  # module-scoped servers start before `cag_home`
        yield


@pytest.fixture(autouse=True)
def cag_home(tmp_path, monkeypatch, models_dir, request) -> Path:
    _clear_shell_settings(monkeypatch)
    home = tmp_path / "cag-home"
    monkeypatch.setenv("CAG_HOME", str(home))
    monkeypatch.setenv("CAG_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")  # `auto` measures the machine; tests pin what they compare
    if request.node.get_closest_marker("real") is None:  # the real model keeps its default block (256 on a CPU)
        monkeypatch.setenv("CAG_PREFILL_BLOCK", str(PREFILL_BLOCK))
    else:
        monkeypatch.delenv("CAG_PREFILL_BLOCK", raising=False)
    return home


@pytest.fixture
def tiny(tiny_model_dir, monkeypatch):
    """CAG_MODEL set to the tiny model, for commands run in this process (typer's CliRunner)."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    return tiny_model_dir


@pytest.fixture
def tiny_engine(tiny_model_dir, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.rag.index import retrieve

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    return Engine(get_settings(), retrieval=retrieve)


@pytest.fixture(scope="session")
def real_lm(models_dir):
    from cag.config import DEFAULT_MODEL
    from cag.model.loading import load_model

    return load_model(DEFAULT_MODEL, models_dir)


@pytest.fixture
def real_engine(real_lm, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.rag.index import retrieve

    return Engine(get_settings(), lm=real_lm, retrieval=retrieve)


@pytest.fixture
def town(tmp_path) -> Path:
    """Four one-line documents (tests.test_shards.DOCS), a shard each with the right --shard-tokens."""
    from tests.test_shards import DOCS

    root = tmp_path / "town"
    root.mkdir()
    for name, text in DOCS.items():
        (root / name).write_text(text + "\n")
    return root


@pytest.fixture
def small_corpus(tmp_path) -> Path:
    """Three short documents written for the tests."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.md").write_text("# Lighthouse\nThe lighthouse keeper is Mara Voss. She lights the lamp at dusk.\n")
    (root / "b.txt").write_text("The ferry leaves the harbour at 7:15 every weekday and returns at 18:40.\n")
    (root / "c.md").write_text("The bakery on Quay Street sells rye bread on Tuesdays only.\n")
    return root
