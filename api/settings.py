"""Settings of the HTTP layer only (the engine's live in cag.config): env prefix CAG_."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAG_", extra="ignore")

    api_keys: str = Field(default="", repr=False)  # comma-separated; set -> Bearer auth on every route but /health
    max_body_bytes: int = 1024 * 1024  # larger request bodies get 413
    max_question_chars: int = 8000  # longer questions get 413 before any tokenizing
    # generations running at once, each on its own thread with CAG_THREADS torch threads, or when that
    # is unset, cores / workers: one thread driving all cores thrashes in OpenMP barriers as soon as
    # anything else runs on the machine (measured: 0.7 vs 10 tok/s, see bench/bench_api.py)
    workers: int = 2
    max_queue: int = 16  # requests allowed to wait for a worker; beyond that 429 + Retry-After
    request_timeout_s: float = 300.0  # queue wait + generation; past it generation stops, 504
    cors_origins: str = ""  # comma-separated origins, "*" for any; CORS is off when empty

    @property
    def keys(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]
