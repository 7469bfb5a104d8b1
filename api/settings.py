"""Settings of the HTTP layer only (the engine's live in cag.config): env prefix CAG_.

Validated once, with ranges, like the engine's: `load_api_settings` turns a bad value into one
`BadSettings` line (`cag serve` prints it and exits 1), never a traceback or a quietly odd server.
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cag.config import settings_error


def _host_or_address(h: str) -> bool:
    """A host name or IPv4 address, or an IPv6 address (bracketed or not)."""
    if re.fullmatch(r"[A-Za-z0-9_.-]+", h):
        return True
    try:
        ipaddress.IPv6Address(h.removeprefix("[").removesuffix("]"))
        return True
    except ValueError:
        return False


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAG_", extra="ignore")

    # comma-separated bearer keys; unset: no authentication; set: a key on every route but /health
    api_keys: str | None = Field(default=None, repr=False)
    max_body_bytes: int = Field(1024 * 1024, ge=1)  # larger request bodies get 413
    max_question_chars: int = Field(8000, ge=1)  # longer questions get 413 before any tokenizing
    # generations admitted at once, each on its own thread (question checks, snapshot loads, and the
    # prompt prefill of `full` and RAG, with CAG_THREADS torch threads, or cores / workers when unset);
    # their decoding runs batched on the engine's one decode thread (CAG_MAX_BATCH at a time), so
    # up to CAG_MAX_BATCH workers keep the batch full
    workers: int = Field(16, ge=1)
    max_queue: int = Field(16, ge=0)  # requests allowed to wait for a worker; beyond that 429 + Retry-After
    request_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)  # queue wait + generation; past it 504
    cors_origins: str = ""  # comma-separated origins, "*" for any; CORS is off when empty
    # Host names (any port) answered besides localhost, 127.0.0.1, [::1], IP addresses and the address
    # `cag serve` binds: comma-separated, "*" for any Host (api/middleware.py SameSite: DNS rebinding)
    allowed_hosts: str = ""
    ui: bool = True  # the chat page at / (api/ui.py); false (or `cag serve --no-ui`): 404 there, the API unchanged

    @field_validator("api_keys")
    @classmethod
    def _holds_a_key(cls, v: str | None) -> str | None:
        # " , " or "" must not quietly mean "no authentication": only leaving it unset says that
        if v is not None and not any(k.strip() for k in v.split(",")):
            raise ValueError("is set but holds no key; unset it to serve without authentication")
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: str) -> str:
        for h in (h.strip() for h in v.split(",")):
            if h and h != "*" and not _host_or_address(h):
                raise ValueError(f"{h!r} is not a host name or address (no scheme, port or path; `*` for any)")
        return v

    @property
    def hosts(self) -> list[str]:
        """CAG_ALLOWED_HOSTS, lower case, IPv6 addresses without their brackets."""
        return [
            h.strip().lower().removeprefix("[").removesuffix("]") for h in self.allowed_hosts.split(",") if h.strip()
        ]

    def serving_on(self, host: str) -> ApiSettings:
        """These settings with the address `cag serve` binds allowed as a Host too (they carry it to Ray replicas)."""
        return self.model_copy(update={"allowed_hosts": ",".join(h for h in (self.allowed_hosts.strip(), host) if h)})

    @property
    def keys(self) -> list[str]:
        return [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]


def load_api_settings(**overrides) -> ApiSettings:
    """ApiSettings with explicit (non-None) overrides on top of the environment; raises BadSettings
    (one line naming the setting, its value and the rule) on a bad value."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ApiSettings(**given)
    except ValidationError as e:
        raise settings_error(e, given) from None
