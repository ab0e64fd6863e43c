"""`scd-serve make-pair-zoo`: base/fine-tune pairs made the way users' pairs are made.

A producer ("base") is pretrained once per architecture on real source code; every consumer
("expert") starts from its weights and is fine-tuned along one axis a real fine-tune varies,
or several at once: another domain (short or long), a LoRA adapter merged in, a rotary base
change (a long-context extension), an instruction format with the loss on answers only.
Two pairs repeat a recipe with a seed that calibration was never developed on (`held_back`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scd_serve.errors import ConfigError

FAMILIES = ("llama", "qwen2")
DOMAINS = ("stdlib", "code", "docs")  # pair/zoo_corpus.py says what each holds
METHODS = ("full", "lora")


@dataclass(frozen=True)
class ZooProducerConfig:
    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    steps: int
    lr: float = 2e-3
    rope_theta: float = 1e4
    seq_len: int = 256
    batch_tokens: int = 2048
    warmup: int = 50

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"producer {self.name}: family must be one of {FAMILIES}, got {self.family!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError(f"producer {self.name}: hidden_size must divide by num_heads, num_heads by "
                              "num_kv_heads")
        check_steps(self.name, self.steps, self.lr, self.seq_len, self.batch_tokens)


@dataclass(frozen=True)
class ZooPairConfig:
    """One consumer, fine-tuned from `producer`'s weights."""

    name: str
    producer: str
    domain: str  # what the fine-tune, calibration and held-out texts are
    steps: int
    lr: float = 1e-3
    method: str = "full"  # "lora": a peft adapter, trained, then merged into the weights
    lora_rank: int = 16
    rope_theta: float | None = None  # a new rotary base (None: the producer's)
    instruct: bool = False  # prompt/answer documents, loss on the answers only
    seq_len: int = 256
    batch_tokens: int = 2048
    warmup: int = 20
    seed: int = 0
    held_back: bool = False  # a seed calibration was never developed on: reported separately

    def __post_init__(self):
        if self.domain not in DOMAINS:
            raise ConfigError(f"pair {self.name}: domain must be one of {DOMAINS}, got {self.domain!r}")
        if self.method not in METHODS:
            raise ConfigError(f"pair {self.name}: method must be one of {METHODS}, got {self.method!r}")
        if self.lora_rank < 1 or (self.rope_theta is not None and self.rope_theta <= 0):
            raise ConfigError(f"pair {self.name}: lora_rank must be >= 1 and rope_theta > 0")
        check_steps(self.name, self.steps, self.lr, self.seq_len, self.batch_tokens)


def check_steps(name: str, steps: int, lr: float, seq_len: int, batch_tokens: int) -> None:
    if steps < 1 or lr <= 0 or seq_len < 8 or batch_tokens < seq_len:
        raise ConfigError(f"{name}: steps >= 1, lr > 0, seq_len >= 8 and batch_tokens >= seq_len, got steps "
                          f"{steps}, lr {lr}, seq_len {seq_len}, batch_tokens {batch_tokens}")


def _producers() -> tuple[ZooProducerConfig, ...]:
    return (
        # Qwen2: q/k/v biases, grouped-query attention (6 heads over 2 K/V heads), head_dim 32
        ZooProducerConfig("qwen", "qwen2", num_layers=6, hidden_size=192, num_heads=6, num_kv_heads=2,
                          intermediate_size=768, steps=2000),
        # Llama: no biases, plain multi-head attention, deeper and narrower, head_dim 32
        ZooProducerConfig("llama", "llama", num_layers=8, hidden_size=128, num_heads=4, num_kv_heads=4,
                          intermediate_size=512, steps=2000),
    )


def _pairs() -> tuple[ZooPairConfig, ...]:
    long_ctx = dict(rope_theta=1e6, seq_len=1024)  # a long-context extension: new base, longer texts
    return (  # the first two are made first: they are built like the pairs users reported
        ZooPairConfig("qwen-rope-code", "qwen", "code", steps=1200, **long_ctx),
        ZooPairConfig("llama-lora-code", "llama", "code", steps=1200, method="lora", lr=2e-3),
        ZooPairConfig("qwen-code-short", "qwen", "code", steps=200),
        ZooPairConfig("qwen-code-long", "qwen", "code", steps=2000),
        ZooPairConfig("qwen-rope", "qwen", "stdlib", steps=400, lr=5e-4, **long_ctx),
        ZooPairConfig("qwen-instruct", "qwen", "code", steps=600, instruct=True, seq_len=512),
        ZooPairConfig("llama-docs", "llama", "docs", steps=800),
        ZooPairConfig("llama-lora-rope-docs", "llama", "docs", steps=800, method="lora", lr=2e-3, **long_ctx),
        ZooPairConfig("qwen-rope-code-s7", "qwen", "code", steps=1200, seed=7, held_back=True, **long_ctx),
        ZooPairConfig("llama-lora-code-s7", "llama", "code", steps=1200, method="lora", lr=2e-3, seed=7,
                      held_back=True),
    )


@dataclass(frozen=True)
class ZooConfig:
    seed: int = 0
    vocab_size: int = 8192
    tokenizer_chars: int = 6_000_000  # characters of each domain's training text the BPE sees
    domain_chars: int = 24_000_000  # most characters of a domain's training split kept (tokenized once)
    package_chars: int = 3_000_000  # most characters one package gives the code or docs domain
    max_position_embeddings: int = 2048
    threads: int = 2
    producers: tuple[ZooProducerConfig, ...] = field(default_factory=_producers)
    pairs: tuple[ZooPairConfig, ...] = field(default_factory=_pairs)
    # eval/: calibration and held-out records of each pair's domain, from different documents
    num_calibration: int = 200
    num_heldout: int = 60
    text_tokens: tuple[int, int] = (256, 768)  # tokens per text record (half prompt, half scored)
    report_texts: int = 24  # held-out texts the report's raw-reuse KL is measured on

    def __post_init__(self):
        names = [p.name for p in self.producers]
        if len(set(names)) != len(names) or len({p.name for p in self.pairs}) != len(self.pairs):
            raise ConfigError("zoo producer names and pair names must be unique")
        for p in self.pairs:
            if p.producer not in names:
                raise ConfigError(f"pair {p.name}: no producer named {p.producer!r} (have {names})")
        lo, hi = self.text_tokens
        if not 16 <= lo <= hi or self.num_calibration < 2 or self.num_heldout < 1 or self.threads < 1:
            raise ConfigError("text_tokens needs 16 <= lo <= hi; num_calibration >= 2, num_heldout >= 1, threads >= 1")

    def pair(self, name: str) -> ZooPairConfig:
        for p in self.pairs:
            if p.name == name:
                return p
        raise ConfigError(f"no zoo pair named {name!r}; have {[p.name for p in self.pairs]}")

    def producer(self, name: str) -> ZooProducerConfig:
        return next(p for p in self.producers if p.name == name)

    def shrunk(self) -> "ZooConfig":
        """Seconds-long: the same code path on tiny models, a small tokenizer and few steps."""
        tiny = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128, steps=3, seq_len=64,
                    batch_tokens=128, warmup=1)
        producers = tuple(replace(p, num_kv_heads=min(p.num_kv_heads, 2), **tiny) for p in self.producers)
        pairs = tuple(replace(p, steps=2, seq_len=64, batch_tokens=128, warmup=1) for p in self.pairs)
        return replace(self, vocab_size=600, tokenizer_chars=150_000, domain_chars=400_000, package_chars=60_000,
                       threads=1, producers=producers, pairs=pairs, num_calibration=4, num_heldout=2,
                       text_tokens=(32, 64), report_texts=2)
