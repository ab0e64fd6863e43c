"""The vLLM KV connector's settings (scd_serve/vllm/): what `--kv-transfer-config`'s
`kv_connector_extra_config` may say, checked once when vLLM builds the connector.

    {"prefill": ["10.0.0.5:50051"], "method": "scd", "codebook": "/models/codebook",
     "min_prompt_tokens": 16, "worker_token": "...", "prefill_timeout_s": 30}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from scd_serve.config.address import check_address
from scd_serve.config.decode import PRIOR_TABLE_MODES
from scd_serve.config.methods import TRANSFER_METHODS
from scd_serve.config.transport import TransportConfig
from scd_serve.errors import ConfigError, check_range

TRANSPORT_KEYS = ("worker_token", "rpc_timeout_s", "prefill_timeout_s", "stall_timeout_s", "max_message_bytes",
                  "tls_cert", "tls_key", "tls_ca", "tls_server_name")


@dataclass(frozen=True)
class ConnectorConfig:
    prefill: tuple[str, ...]  # HOST:PORT of scd-serve prefill workers, tried in turn
    method: str = "scd"  # the transfer method asked of them (a codec of TRANSFER_METHODS)
    codebook: str = ""  # the codebook directory (methods that need one: reuse, scd, scd-int8)
    # shorter prompts are prefilled by vLLM itself: a transfer's fixed costs outweigh them
    min_prompt_tokens: int = 16
    # the feature prior's vocabulary table made at start (codec/prior_table.py), as `scd-serve
    # decode --prior-table`: "on", "auto" (when predicted within prior_table_budget_s) or "off"
    prior_table: str = "auto"
    prior_table_budget_s: float = 60.0
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("kv_connector_extra_config.prefill: name at least one scd-serve prefill worker "
                              "(HOST:PORT)", field="prefill")
        for address in self.prefill:
            try:
                check_address(address)
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config.prefill: {exc}", field="prefill") from None
        if self.method not in TRANSFER_METHODS:
            raise ConfigError(f"kv_connector_extra_config.method must be one of {', '.join(TRANSFER_METHODS)}, "
                              f"got {self.method!r}", field="method")
        if self.codebook and not os.path.isdir(self.codebook):
            raise ConfigError(f"kv_connector_extra_config.codebook: no such directory {self.codebook!r}",
                              field="codebook")
        if isinstance(self.min_prompt_tokens, bool) or not isinstance(self.min_prompt_tokens, int) \
                or self.min_prompt_tokens < 2:
            raise ConfigError(f"kv_connector_extra_config.min_prompt_tokens must be an integer >= 2, "
                              f"got {self.min_prompt_tokens!r}", field="min_prompt_tokens")
        if self.prior_table not in PRIOR_TABLE_MODES:
            raise ConfigError(f"kv_connector_extra_config.prior_table must be one of {', '.join(PRIOR_TABLE_MODES)}, "
                              f"got {self.prior_table!r}", field="prior_table")
        check_range("kv_connector_extra_config.prior_table_budget_s", self.prior_table_budget_s, 0, 86400)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        """From vLLM's kv_connector_extra_config; an unknown key is an error naming the known ones
        (a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"transport"}
        unknown = sorted(set(extra) - own - set(TRANSPORT_KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(own | set(TRANSPORT_KEYS)))})", field=unknown[0])
        prefill = extra.pop("prefill", ())
        if isinstance(prefill, str):
            prefill = [p for p in prefill.split(",") if p]
        if not isinstance(prefill, (list, tuple)):
            raise ConfigError("kv_connector_extra_config.prefill must be a list of HOST:PORT strings",
                              field="prefill")
        transport = {k: extra.pop(k) for k in TRANSPORT_KEYS if k in extra}
        transport.setdefault("worker_token", os.environ.get("SCD_WORKER_TOKEN", ""))
        try:
            transport_config = TransportConfig(**transport)
        except TypeError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        return cls(prefill=tuple(prefill), transport=transport_config, **extra)
