"""HTTP API settings: listener, limits on request bodies and sampling parameters, auth."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Name reported by /v1/models and in responses; "" = the backend's model name.
    model_name: str = ""
    # --served-model-name: every name a request's `model` may use (all listed by /v1/models);
    # the first is reported when a request names none. () = model_name alone.
    served_model_names: tuple[str, ...] = ()
    # Bearer token required on every route except /live and /ready; "" = no auth.
    api_key: str = field(default="", repr=False)
    # Request bodies larger than this get 413 (also when sent chunked without Content-Length).
    max_body_bytes: int = 1 << 20
    # Prompt + max_tokens must fit; should equal the engine's max_model_len.
    max_model_len: int = 2048
    # Upper bound for max_tokens; when a request omits it: default_max_tokens (at most the
    # cap), or what still fits in max_model_len after the prompt if that is less.
    max_tokens_cap: int = 2048
    default_max_tokens: int = 256
    # Stop sequences: at most this many, each at most max_stop_chars characters.
    max_stop: int = 4
    max_stop_chars: int = 64
    # Transfer method when the request has no `scd_method` ("local" = no transfer).
    default_method: str = "local"
    # Seconds a request may take end to end before 504.
    request_timeout_s: float = 300.0
    # Serve /docs and /openapi.json (off in hardened deployments).
    enable_docs: bool = True
    # Idle keep-alive connections are closed after this many seconds (uvicorn).
    timeout_keep_alive_s: int = 5

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"api.port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_model_len", "max_tokens_cap", "default_max_tokens",
                     "max_stop_chars", "timeout_keep_alive_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"api.{name} must be an integer >= 1, got {value!r}")
        if self.max_stop < 0:
            raise ConfigError(f"api.max_stop must be >= 0, got {self.max_stop}")
        if not (0 < self.request_timeout_s <= 86400):
            raise ConfigError(f"api.request_timeout_s must be in (0, 86400], got {self.request_timeout_s}")
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ConfigError(f"api.served_model_names must be non-empty names, got {self.served_model_names!r}")
        if not self.default_method:
            raise ConfigError("api.default_method must be a method name, e.g. 'local' or 'scd'")
        if self.api_key and (self.api_key != self.api_key.strip() or len(self.api_key) < 8):
            raise ConfigError("api.api_key must be at least 8 characters without surrounding spaces")
