"""`ServerConfig`: the HTTP layer's limits and defaults (the engine has its own `EngineConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from runtime.sampling_params import SamplingDefaults

# filled from the `model:` config node by runtime.serve, not part of the `server:` node
SERVER_FIELDS_FROM_MODEL = ("default_num_loops", "default_exit_threshold", "sampling")


@dataclass(frozen=True)
class ServerConfig:
    """Limits and request defaults of one served model.

    `max_num_requests` caps requests queued plus running in the engine; past it a request gets
    429 with `Retry-After: retry_after_s` instead of waiting unboundedly.
    """

    model_name: Optional[str] = None        # the id clients pass as "model"; None: the folder's name
    max_num_requests: int = 512             # queued + running engine requests before 429
    retry_after_s: int = 1                  # the Retry-After of a 429 / 503
    max_body_bytes: int = 1 << 20           # larger request bodies get 413
    default_max_tokens: int = 256           # a completion without max_tokens (capped by the context); a
                                            # chat completion without one may fill the context (vLLM's rule)
    max_num_stop_strings: int = 16
    shutdown_timeout_s: float = 30.0        # at shutdown, how long in-flight requests may still run
    # `/v1/*` needs `Authorization: Bearer <api_key>` when set (vLLM's --api-key); the CLI also reads
    # LOOPSTACK_API_KEY, which keeps the key off the command line
    api_key: Optional[str] = field(default=None, repr=False)
    # CORS: web pages of these origins may call the API ("*": any, vLLM's default); none by default,
    # so a page the operator visits cannot drive a server without a key and read its answers
    allowed_origins: tuple[str, ...] = ()
    default_num_loops: Optional[int] = None       # None: the model's own depth
    default_exit_threshold: Optional[float] = None  # None: the model's own threshold
    # what a request leaves out: the model's generation_config, as runtime.generate applies it
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        origins = self.allowed_origins
        object.__setattr__(self, "allowed_origins", (origins,) if isinstance(origins, str) else tuple(map(str, origins)))
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or null: no key)")
        for name in ("max_num_requests", "max_body_bytes", "default_max_tokens", "max_num_stop_strings"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.retry_after_s, int) and self.retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be an integer >= 0, got {self.retry_after_s!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
