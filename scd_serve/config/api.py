"""HTTP API settings: listener, limits on request bodies and sampling parameters, auth."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.config.methods import LOCAL
from scd_serve.errors import ConfigError, check_range


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""  # reported by /v1/models and in responses; "" = the backend's
    model_root: str = ""  # /v1/models' `root`: the model directory it serves ("" = the model name)
    # Every name a request's `model` may use (the first is reported); () = model_name alone.
    served_model_names: tuple[str, ...] = ()
    api_key: str = field(default="", repr=False)  # bearer token on every route but probes; "" = none
    max_body_bytes: int = 1 << 20  # larger bodies get 413 (chunked ones too)
    # JSON nested deeper gets 400 before it is parsed (chat messages with content parts nest 5)
    max_json_depth: int = 64
    max_model_len: int = 2048  # prompt + max_tokens must fit; the engine's max_model_len
    # Upper bound for max_tokens; when a request omits it: default_max_tokens (at most the
    # cap), or what still fits in max_model_len after the prompt if that is less.
    max_tokens_cap: int = 2048
    default_max_tokens: int = 256
    max_stop: int = 4  # stop sequences per request
    max_stop_chars: int = 64  # characters per stop sequence
    default_method: str = LOCAL  # for a request without `scd_method`
    request_timeout_s: float = 300.0  # end to end, then 504
    enable_docs: bool = True  # /docs and /openapi.json (off in hardened deployments)
    timeout_keep_alive_s: int = 5  # idle keep-alive connections are closed after this (uvicorn)
    chat_template: str = ""  # a Jinja chat template (--chat-template) instead of the tokenizer's; "" = its own
    header_timeout_s: float = 10.0  # a request's headers must be complete this soon (api/http_server.py)

    def __post_init__(self) -> None:
        check_range("api.port", self.port, 0, 65535)
        for name in ("max_body_bytes", "max_json_depth", "max_model_len", "max_tokens_cap", "default_max_tokens",
                     "max_stop_chars", "timeout_keep_alive_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"api.{name} must be an integer >= 1, got {value!r}")
        check_range("api.max_json_depth", self.max_json_depth, 1, 512)  # 512: json's recursion limit is ~1000
        if self.max_stop < 0:
            raise ConfigError(f"api.max_stop must be >= 0, got {self.max_stop}")
        check_range("api.request_timeout_s", self.request_timeout_s, 0, 86400, open_low=True)
        check_range("api.header_timeout_s", self.header_timeout_s, 0, 3600, open_low=True)
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ConfigError(f"api.served_model_names must be non-empty names, got {self.served_model_names!r}")
        if not self.default_method:
            raise ConfigError("api.default_method must be a method name, e.g. 'local' or 'scd'")
        if self.api_key and (self.api_key != self.api_key.strip() or len(self.api_key) < 8):
            raise ConfigError("api.api_key must be at least 8 characters without surrounding spaces")
