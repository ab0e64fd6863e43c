"""How the embedded producer/consumer pair is made (`scd-serve make-demo-pair`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class StageConfig:
    """One training stage: the producer's pretraining or the consumer's fine-tune."""

    style: str  # "base" or "expert" (scd_serve/pair/data.py)
    steps: int
    lr: float
    batch_tokens: int  # about this many tokens per optimizer step
    min_len: int  # document length range, ramped from start_max_len to max_len (curriculum)
    start_max_len: int
    max_len: int
    ramp_frac: float  # fraction of the steps over which the length range widens
    long_frac: float = 0.0  # share of documents drawn up to long_len (length generalization)
    long_len: int = 0
    warmup: int = 50
    lm_weight: float = 0.1  # loss weight of non-answer tokens (answers weigh 1)
    fact_prob: float = 0.4  # share of context sentences that are facts (the rest: filler)
    question_rate: float = 0.05  # questions per document token
    copy_frac: float = 0.0  # share of documents that are repeated-span copy practice
    copy_vocab: int = 0  # copy practice draws from this many words (0: all keys and values)

    def __post_init__(self):
        if self.style not in ("base", "expert"):
            raise ConfigError(f"stage style must be 'base' or 'expert', got {self.style!r}")
        if self.steps < 1 or self.lr <= 0 or self.batch_tokens < 16:
            raise ConfigError("stage needs steps >= 1, lr > 0 and batch_tokens >= 16")
        if not 16 <= self.min_len <= self.start_max_len <= self.max_len:
            raise ConfigError("stage lengths must satisfy 16 <= min_len <= start_max_len <= max_len")
        if not 0.0 <= self.long_frac <= 1.0 or (self.long_frac > 0 and self.long_len < self.max_len):
            raise ConfigError("long_frac must be in [0, 1] and long_len >= max_len when used")


@dataclass(frozen=True)
class PairConfig:
    seed: int = 0  # the random seed (weights and data order)
    num_layers: int = 8
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 192
    producer_rope_theta: float = 1e4
    consumer_rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    tie_embeddings: bool = True  # copying a token is then nearly free: induction forms much sooner
    threads: int = 1  # with OpenMP on a shared 2-core box, 2 threads ran 3-5x slower than 1
    # progressive stacking (scd_serve/pair/grow.py): a shallow_layers-deep model learns the
    # lookup first, then grows to num_layers; 0 trains num_layers from scratch
    shallow_layers: int = 2
    shallow: StageConfig = field(default_factory=lambda: StageConfig(  # copy practice only
        style="base", steps=1000, lr=2e-3, batch_tokens=3072, min_len=40, start_max_len=72,
        max_len=72, ramp_frac=0.0, warmup=10, lm_weight=0.05, copy_frac=1.0))
    producer: StageConfig = field(default_factory=lambda: StageConfig(
        style="base", steps=700, lr=2e-3, batch_tokens=3072, min_len=48, start_max_len=128,
        max_len=512, ramp_frac=0.4, long_frac=0.05, long_len=1024, warmup=20, lm_weight=0.05,
        copy_frac=0.25))
    consumer: StageConfig = field(default_factory=lambda: StageConfig(
        style="expert", steps=120, lr=5e-4, batch_tokens=4096, min_len=128, start_max_len=512,
        max_len=1024, ramp_frac=0.2, long_frac=0.1, long_len=2048, warmup=20, lm_weight=0.05,
        copy_frac=0.1))

    def __post_init__(self):
        if self.num_layers < 1 or self.hidden_size % self.num_heads:
            raise ConfigError("num_layers must be >= 1 and hidden_size divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads (GQA)")
        if self.threads < 1:
            raise ConfigError("threads must be >= 1")
        if self.shallow_layers < 0 or (self.shallow_layers and self.num_layers % self.shallow_layers):
            raise ConfigError("shallow_layers must be 0 or divide num_layers")

    def shrunk(self) -> "PairConfig":
        """A seconds-long version for tests: same code path, tiny model and few steps."""
        small = dict(steps=3, batch_tokens=256, min_len=32, start_max_len=48, max_len=64,
                     long_frac=0.0, long_len=0, warmup=1)
        return replace(self, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                       intermediate_size=64, threads=1, shallow_layers=1,
                       shallow=replace(self.shallow, **small),
                       producer=replace(self.producer, **small), consumer=replace(self.consumer, **small))
