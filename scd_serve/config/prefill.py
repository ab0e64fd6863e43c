"""Prefill worker settings: model, listener, admission, code cache and transfer lease."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.config.model import DTYPE_CHOICES
from scd_serve.config.transport import MiB, TransportConfig
from scd_serve.errors import ConfigError, check_range

DEFAULT_PRODUCER = "models/demo-pair/producer"
DEFAULT_CODEBOOK = "models/demo-pair/codebook"


@dataclass(frozen=True)
class PrefillConfig:
    model: str = DEFAULT_PRODUCER
    codebook: str = DEFAULT_CODEBOOK  # "" or missing directory = codebook-free methods only
    # codebooks of further consumers (experts) this producer feeds: their codebook methods too
    expert_codebooks: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on the CPU
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = the OS picks
    metrics_port: int = 0  # HTTP GET /metrics for Prometheus (behind the worker token); 0 = none
    control_url: str = ""  # where to register and send heartbeats ("" = standalone)
    advertise: str = ""  # HOST:PORT decode workers should dial ("" = host:bound port)
    max_concurrent: int = 4  # transfers at once; one more gets RESOURCE_EXHAUSTED (no queue)
    max_prompt_tokens: int = 0  # tokens; 0 = the model's max_position_embeddings
    transfer_lease_s: float = 60.0  # a transfer holds its resources at most this long, reader or not
    # Code cache for repeated prompts: bounded by bytes and entries (LRU).
    cache_bytes: int = 256 * MiB
    cache_entries: int = 1024
    # The producer's prefix cache: K/V of this many tokens kept (paged, LRU) so that a prompt
    # starting with one seen before (a chat's next turn) is prefilled from there on; 0 = off.
    prefix_cache_tokens: int = 16384
    # Cached codes are resent in chunks of up to this many bytes (1 = one layer per chunk), the
    # first and last layer alone (transport.chunking.group_layers). 32 KiB: a message costs
    # ~0.2-0.4 ms per side in Python gRPC, the wire time of ~32 KB at 1 Gbit/s.
    chunk_bytes: int = 32 * 1024
    shutdown_grace_s: float = 5.0  # to finish running transfers after SIGTERM
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("prefill.model must name a model directory")
        for name in ("port", "metrics_port"):
            check_range(f"prefill.{name}", getattr(self, name), 0, 65535)
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError(f"prefill.metrics_port must differ from the gRPC port {self.port}")
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"prefill.dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        for name in ("max_concurrent", "cache_entries", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"prefill.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens < 0 or self.cache_bytes < 0 or self.prefix_cache_tokens < 0:
            raise ConfigError("prefill.max_prompt_tokens, cache_bytes and prefix_cache_tokens must be >= 0")
        if self.chunk_bytes > self.transport.max_message_bytes // 2:
            raise ConfigError(f"prefill.chunk_bytes ({self.chunk_bytes}) must be at most half of "
                              f"max_message_bytes ({self.transport.max_message_bytes})")
        for name in ("transfer_lease_s", "shutdown_grace_s"):
            if not (0 < getattr(self, name) <= 3600):
                raise ConfigError(f"prefill.{name} must be in (0, 3600] seconds")
        if self.control_url and not self.control_url.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"prefill.control_url must look like tcp://HOST:PORT, got {self.control_url!r}")
