"""Settings: flags override CAG_* environment variables, which override these defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAG_", protected_namespaces=(), populate_by_name=True)

    home: Path = Path.home() / ".cag"  # holds index.db, snapshots/, models/
    model: str = DEFAULT_MODEL  # the embedded default, a model folder, or a hub id
    dtype: str = "float32"  # compute dtype of the weights: float32 | bfloat16 (faster where the CPU has bf16 units)
    kv_dtype: str = "float16"  # storage dtype of snapshot tensors (float16 | bfloat16 | float32)
    chunk_tokens: int = 512  # prefill chunk: bounds activation memory, drives the progress bar
    question_room: int = 256  # tokens reserved after the knowledge for the question suffix
    answer_room: int = 256  # tokens reserved for the answer; also the max_tokens ceiling
    max_tokens: int = 128  # default answer length
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    warm_buffers: int = 2  # request buffers kept filled per resident snapshot (concurrent hits copy nothing)
    resident_bytes: int = 2 * 1024**3  # LRU budget for snapshots kept in memory (server)
    ttl_s: float = 0.0  # snapshot time-to-live; 0 = never expires
    models_dir_override: Path | None = Field(default=None, alias="CAG_MODELS_DIR")  # shared model store

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
    """Settings with explicit (non-None) overrides from flags on top of the environment."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
