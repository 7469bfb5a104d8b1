"""Settings: flags override CAG_* environment variables, which override these defaults.

Every setting is validated here, once, with its range: a bad value is one `BadSettings` line from
`get_settings`, before any work, never a traceback or a nonsense run (a negative TTL never expires,
a zero chunk never ends). The README's Settings table lists the same ranges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cag.errors import BadSettings

DEFAULT_MODEL = "smollm2-135m-instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAG_", protected_namespaces=(), populate_by_name=True)

    home: Path = Path.home() / ".cag"  # holds index.db, snapshots/, models/
    model: str = Field(DEFAULT_MODEL, min_length=1)  # the embedded default, a model folder, or a hub id
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when torch sees one
    # compute dtype of the model (auto: cag.model.auto_weights.compute_dtype)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # format decode multiplies in (cag/model/weights.py); auto: measured at load, bf16 where it beats fp32
    weights: Literal["auto", "fp32", "bf16", "int8", "int4"] = "auto"
    # the kernels decode rows run on (cag/kernels/native.py, built once per machine): amx / avx512 = cag's own
    # (attention on AMX tiles / by AVX512-BF16 dot products; int4 and bf16 products; fused norm and
    # rope), torch = torch's; auto: avx512 where it can run over bf16 K/V (faster than amx on AMX CPUs), else torch
    decode_kernels: Literal["auto", "amx", "avx512", "avx2", "torch"] = "auto"
    # keep the packed weights (int4, int8, q8) under CAG_MODELS_DIR/packed and read them at the next load
    # instead of packing again (cag/model/packed_cache.py): most of a load's time, for the file's bytes on disk
    keep_packed: bool = True
    # storage dtype of snapshot tensors; auto: bfloat16 where decode attends in bf16 (no conversion at
    # load), else float16; int8: quantized blocks with one fp16 scale each (store/kv_int8.py)
    kv_dtype: Literal["auto", "float16", "bfloat16", "float32", "int8"] = "auto"
    # question prefill piece (rows a pass; other requests decode a step between pieces): bounds activation
    # memory and how long one long prompt holds up the others; 0 = auto: 256 on a CPU (~0.7 s a pass for
    # SmolLM2 on 2 cores), 4096 on CUDA (a pass there is one launch of every kernel: larger ones fill the chip)
    chunk_tokens: int = Field(0, ge=0)
    # rows of every knowledge-prefill forward (cag.runtime.kv_cache.prefill_knowledge): the prefix is prefilled in
    # blocks of exactly this many rows at multiples of it, so a row's K/V never depend on how the prefill was
    # split; part of every snapshot's key; 0 = auto: 256 on a CPU, 2048 on CUDA
    prefill_block: int = Field(0, ge=0, le=16384)
    # input limits, checked on file sizes before anything is read (cag/knowledge/corpus.py): bounded time and memory
    max_document_bytes: int = Field(32 * 1024**2, ge=1)  # one document file
    max_corpus_bytes: int = Field(128 * 1024**2, ge=1)  # all the documents of a corpus together
    question_room: int = Field(256, ge=1)  # tokens reserved after the knowledge for the question suffix
    answer_room: int = Field(256, ge=1)  # tokens reserved for the answer; also the max_tokens ceiling
    # cag+rag (cag.answering.retrieval): the size of a quoted passage, in tokens of the model's tokenizer;
    # 0 = RAG's (384)
    quote_tokens: int = Field(0, ge=0, le=8192)
    max_tokens: int = Field(128, ge=1)  # default answer length
    threads: int = Field(0, ge=0)  # torch intra-op threads; 0 = torch's default
    max_batch: int = Field(16, ge=1, le=1024)  # requests decoded together, one forward per step (cag.runtime.decoder)
    # rows of every decode step (cag.runtime.decoder): padding rows fill a step, so a request's rows meet
    # one shape and one kernel alone or batched; 0 = auto: max_batch on CUDA, as many as decode on the CPU
    decode_rows: int = Field(0, ge=0, le=1024)
    # CUDA: each decode step a replayed graph (cag.runtime.cuda_graphs); false: launched op by op
    cuda_graphs: bool = True
    resident_bytes: int = Field(2 * 1024**3, ge=0)  # LRU budget for snapshots kept in memory (server)
    # conversations' K/V kept between turns (cag.runtime.kept_conversations): LRU, counted in resident_bytes
    # too; 0 keeps none
    conversation_bytes: int = Field(512 * 1024**2, ge=0)
    # `cag serve`: prefill and keep every corpus's cag+rag quotes at start and after a refresh (cag.answering.quotes)
    warm_quotes: bool = False
    quote_bytes: int = Field(1024**3, ge=0)  # warmed quotes' K/V: LRU, counted in resident_bytes too; 0 keeps none
    ttl_s: float = Field(0.0, ge=0, allow_inf_nan=False)  # snapshot time-to-live; 0 = never expires
    # where snapshots live: unset = CAG_HOME/snapshots only; s3://bucket/prefix = a shared S3-compatible store
    store: str | None = None
    store_cache_bytes: int = Field(20 * 1024**3, ge=0)  # local read cache of store blobs (LRU by access)
    # a known corpus's ref is looked up again after this
    store_ref_ttl_s: float = Field(10.0, ge=0, allow_inf_nan=False)
    # gc spares unnamed store blobs younger than this
    store_gc_grace_s: float = Field(3600.0, ge=0, allow_inf_nan=False)
    models_dir_override: Path | None = Field(default=None, alias="CAG_MODELS_DIR")  # shared model store

    @field_validator("home", mode="before")
    @classmethod
    def _home_not_empty(cls, home):
        if isinstance(home, str) and not home.strip():  # Path("") would silently be the working directory
            raise ValueError("empty; unset it for the default ~/.cag")
        return home

    @field_validator("models_dir_override", mode="before")
    @classmethod
    def _empty_is_unset(cls, folder):
        return None if isinstance(folder, str) and not folder.strip() else folder

    @field_validator("store", mode="before")
    @classmethod
    def _store_url(cls, url):
        if url is None or (isinstance(url, str) and not url.strip()):
            return None  # empty = unset: the local folder only
        from urllib.parse import urlparse

        u = urlparse(str(url).strip())
        if u.scheme != "s3" or not u.netloc:
            raise ValueError("use s3://bucket or s3://bucket/prefix (unset: snapshots stay in CAG_HOME)")
        return str(url).strip().rstrip("/")

    @field_validator("home")
    @classmethod
    def _home_is_a_folder(cls, home: Path) -> Path:
        if home.exists() and not home.is_dir():  # created on first use when missing
            raise ValueError("not a directory")
        return home

    @property
    def index_path(self) -> Path:
        return self.home / "index.db"

    @property
    def snapshots_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def models_dir(self) -> Path:
        return self.models_dir_override or self.home / "models"


def get_settings(**overrides) -> Settings:
    """Settings with explicit (non-None) overrides from flags on top of the environment.
    Raises BadSettings (one line naming the setting, its value and the rule) on a bad value."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as e:
        raise settings_error(e, given) from None


def settings_error(e: ValidationError, flags: dict | None = None) -> BadSettings:
    """One line for a settings validation error: `CAG_CHUNK_TOKENS='abc': Input should be ...`.
    Values given as flags (keyword overrides) are named by field, the rest by environment variable."""
    parts = []
    for err in e.errors(include_url=False):
        field = str(err["loc"][0]) if err["loc"] else "?"
        name = field if field in (flags or {}) or field.startswith("CAG_") else f"CAG_{field.upper()}"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{name}={err.get('input')!r}: {msg}")
    return BadSettings("bad setting " + "; ".join(parts).replace("\n", " "))
