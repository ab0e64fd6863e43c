"""Decode worker settings: consumer model, HTTP listener, prefill peers, transfer policy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scd_serve.config.methods import LOCAL
from scd_serve.config.model import DTYPE_CHOICES
from scd_serve.config.transport import TransportConfig
from scd_serve.config.address import check_address
from scd_serve.errors import ConfigError, check_range

DEFAULT_CONSUMER = "models/demo-pair/consumer"
DEFAULT_CODEBOOK = "models/demo-pair/codebook"
FALLBACKS = (LOCAL, "none")
PRIOR_TABLE_MODES = ("auto", "on", "off")  # of the token prior's vocabulary table (codec/prior_table.py)


@dataclass(frozen=True)
class ChooserConfig:
    """The `auto` method (decode/chooser.py): which methods it may pick, how it learns."""

    # The quality budget. Where the codebook measured a method's top-1 agreement (the share of next
    # tokens equal to the consumer's own, on held-out prompts), it must reach min_top1 (None: the
    # codebook's target, 0.95 by default); where it did not, the method's KL must be at most
    # quality_budget (None: the codebook's KL budget). A quality_budget set here holds for every
    # method. raw and identity are lossless only where producer == consumer.
    quality_budget: float | None = None
    min_top1: float | None = None
    smoothing: float = 0.5  # weight of the newest measurement in each smoothed estimate
    # An estimate not refreshed for this long is stale: the next request that would not
    # refresh it on its own re-measures it (a transfer over that link, or a local prefill).
    stale_s: float = 30.0
    # A stale local estimate is re-measured only within this factor of the best option's
    # prediction (a transfer always is: its link may have recovered).
    probe_ratio: float = 3.0
    cache_entries: int = 4096  # prompts remembered as cached at a prefill worker

    def __post_init__(self) -> None:
        b = self.quality_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0):
            raise ConfigError(f"decode.chooser.quality_budget must be a finite KL >= 0 (or unset), got {b!r}")
        t = self.min_top1
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1):
            raise ConfigError(f"decode.chooser.min_top1 must be a share in [0, 1] (or unset), got {t!r}")
        check_range("decode.chooser.smoothing", self.smoothing, 0, 1, open_low=True)
        check_range("decode.chooser.stale_s", self.stale_s, 0.1, 3600)
        check_range("decode.chooser.probe_ratio", self.probe_ratio, 1, 100)
        check_range("decode.chooser.cache_entries", self.cache_entries, 0, 1_000_000)


def split_peers(value: str) -> tuple[str, ...]:
    """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), each checked to be HOST:PORT."""
    peers = tuple(p.strip() for p in value.split(",") if p.strip())
    for p in peers:
        try:
            check_address(p)
        except ValueError:
            raise ConfigError(f"peer {p!r} is not HOST:PORT") from None
    return peers


@dataclass(frozen=True)
class DecodeConfig:
    model: str = DEFAULT_CONSUMER
    codebook: str = DEFAULT_CODEBOOK  # "" or missing directory = codebook-free methods only
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on the CPU
    host: str = "127.0.0.1"
    port: int = 8100  # HTTP; 0 = the OS picks
    control_url: str = ""  # "" = no control plane (static peers only)
    advertise: str = ""  # HOST:PORT the gateway should dial; "" = host:bound port
    prefill: tuple[str, ...] = ()  # static prefill peers (HOST:PORT), besides those the registry names
    method: str = "scd"  # default transfer method ("local", "auto", ...); requests pick with scd_method
    fallback: str = "local"  # a failed transfer: "local" prefills here, "none" fails the request (503)
    max_attempts: int = 2  # prefill workers tried per request
    # Circuit breaker per prefill peer: consecutive failed transfers that open it, and the first
    # cool-down before one probe transfer (doubling on each failed probe, up to 30 s).
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    health_period_s: float = 1.0  # health check / reconnect period of prefill peers
    allow_incompatible: bool = False  # accept a peer whose handshake differs (logged loudly)
    expect_producer: str = ""  # refuse other producer fingerprints ("" = the codebook's, or any)
    shutdown_grace_s: float = 10.0
    transport: TransportConfig = field(default_factory=TransportConfig)
    chooser: ChooserConfig = field(default_factory=ChooserConfig)  # the `auto` method
    # The OpenAI API and the engine it serves
    api_key: str = field(default="", repr=False)  # bearer token clients must send ("" = none)
    served_model_names: tuple[str, ...] = ()  # names clients may put in `model` (() = the directory's name)
    request_timeout_s: float = 300.0  # a request running this long ends with 504
    max_model_len: int = 0  # prompt + output (0 = the model's context, lowered to what the KV pool holds)
    num_blocks: int = 0  # KV pool blocks (0 = sized from memory)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device this worker may use, weights included
    kv_cache_gib: float = 0.0  # KV pool size (0 = from gpu_memory_utilization, or a quarter of free RAM)
    # The feature prior's vocabulary table (codec/prior_table.py), made before serving: "on",
    # "auto" (when predicted within prior_table_budget_s) or "off".
    prior_table: str = "auto"
    prior_table_budget_s: float = 60.0
    max_num_seqs: int = 32  # sequences decoding at once (the batch bound; vLLM's --max-num-seqs)
    max_num_batched_tokens: int = 512  # prompt tokens prefilled per engine step (vLLM's name)
    chat_template: str = ""  # a Jinja chat template file, or the template itself ("" = the tokenizer's)
    seed: int | None = None  # seeds the engine's stream of seeds for requests without one (vLLM's --seed)
    json_whitespace: int = 16  # structured outputs: most blanks between two JSON elements (0: compact JSON)
    enable_prefix_caching: bool = True  # reuse cached K/V blocks of prompts' shared prefixes (vLLM's flag)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("decode.model must name a model directory")
        check_range("decode.port", self.port, 0, 65535)
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"decode.dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"decode.fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        check_range("decode.max_attempts", self.max_attempts, 1, 8)
        check_range("decode.breaker_failures", self.breaker_failures, 1, 100)
        check_range("decode.breaker_cooldown_s", self.breaker_cooldown_s, 0.01, 30)
        check_range("decode.health_period_s", self.health_period_s, 0.05, 60)
        if not self.method:
            raise ConfigError("decode.method must name a transfer method (or 'local')")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"decode.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_model_len < 0 or self.num_blocks < 0:
            raise ConfigError(f"decode.max_model_len and num_blocks must be >= 0 (0 = automatic), got "
                              f"{self.max_model_len} and {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"decode.gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.kv_cache_gib < 0:
            raise ConfigError(f"decode.kv_cache_gib (--kv-cache-gib) must be >= 0 (0 = automatic), "
                              f"got {self.kv_cache_gib}")
        if self.prior_table not in PRIOR_TABLE_MODES or not 0 <= self.prior_table_budget_s <= 86400:
            raise ConfigError(f"decode.prior_table must be one of {', '.join(PRIOR_TABLE_MODES)} and "
                              f"prior_table_budget_s in [0, 86400], got {self.prior_table!r} and "
                              f"{self.prior_table_budget_s}")
        check_range("decode.max_num_seqs", self.max_num_seqs, 1, 4096)
        check_range("decode.max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(f"decode.seed (--seed) must be in [0, 2^63), got {self.seed}")
        if self.control_url and not self.control_url.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"decode.control_url must look like tcp://HOST:PORT, got {self.control_url!r}")
        split_peers(",".join(self.prefill))
