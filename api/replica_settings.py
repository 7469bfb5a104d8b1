"""Settings of `cag serve --replicas N` (Ray Serve) only: env prefix CAG_, flags win.

They live beside the HTTP layer's settings, not in cag.config: the engine never reads them, only
the command that deploys replicas does. Validated like every other setting: a bad value is one
`BadSettings` line and exit 1 before Ray is started.
"""

from __future__ import annotations

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from cag.config import settings_error
from cag.errors import BadSettings


class ReplicaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAG_", extra="ignore")

    replicas: int = Field(0, ge=0)  # engine replicas on Ray Serve; 0 = plain `cag serve` (no Ray)
    ray_address: str | None = None  # an existing cluster (ray://... or host:port); unset: a local Ray instance
    # corpora a replica keeps resident (Serve's max_num_models_per_replica); the least recently asked is dropped
    corpora_per_replica: int = Field(3, ge=1)
    # how long a question waits for a replica holding its corpus (all full) before another replica loads it
    spill_after_s: float = Field(2.0, gt=0, allow_inf_nan=False)
    cpus_per_replica: float = Field(1.0, gt=0, allow_inf_nan=False)  # Ray CPUs reserved; torch threads follow it
    gpus_per_replica: float = Field(0.0, ge=0, allow_inf_nan=False)  # >0: the replica asks Ray for a GPU (CUDA path)
    # autoscaling (Serve's autoscaling_config) when max_replicas is set: between min and max, starting at `replicas`
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0, allow_inf_nan=False)  # per replica, what Serve scales to

    def check(self) -> ReplicaSettings:
        """The rules between settings (each one's own range is checked by its field)."""
        if self.max_replicas is None and self.min_replicas is not None:
            raise BadSettings(
                "bad setting CAG_MIN_REPLICAS: needs CAG_MAX_REPLICAS (autoscaling is on only with a maximum)"
            )
        low = 1 if self.min_replicas is None else self.min_replicas
        if self.max_replicas is not None and self.replicas and not low <= self.replicas <= self.max_replicas:
            raise BadSettings(f"bad setting CAG_REPLICAS={self.replicas}: must lie between the minimum ({low}) and the "
                              f"maximum ({self.max_replicas}) replicas")
        return self

    @property
    def autoscaling(self) -> dict | None:
        """Serve's autoscaling_config, or None for a fixed number of replicas."""
        if self.max_replicas is None:
            return None
        return {
            "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
        }

    @property
    def most_replicas(self) -> int:
        return self.max_replicas or self.replicas


def load_replica_settings(**overrides) -> ReplicaSettings:
    """ReplicaSettings with explicit (non-None) overrides on top of the environment; raises BadSettings."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = ReplicaSettings(**given)
    except ValidationError as e:
        raise settings_error(e, given) from None
    return settings.check()
