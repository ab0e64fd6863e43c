"""How the embedded producer/consumer pair is made (`scd-serve make-demo-pair`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scd_serve.errors import ConfigError


def check_stage(stage) -> None:
    """What both recipes' stages need: a known style, a positive schedule, ordered lengths."""
    if stage.style not in ("base", "expert"):
        raise ConfigError(f"stage style must be 'base' or 'expert', got {stage.style!r}")
    if stage.steps < 1 or stage.lr <= 0 or stage.batch_tokens < 16:
        raise ConfigError("stage needs steps >= 1, lr > 0 and batch_tokens >= 16")
    if not 16 <= stage.min_len <= stage.start_max_len <= stage.max_len:
        raise ConfigError("stage lengths must satisfy 16 <= min_len <= start_max_len <= max_len")


@dataclass(frozen=True)
class StageConfig:
    """One training stage: the producer's pretraining or the consumer's fine-tune."""

    style: str  # "base" or "expert" (scd_serve/corpus/qa.py)
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
        check_stage(self)
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


@dataclass(frozen=True)
class ContextStageConfig:
    """One stage of the context pair (scd_serve/pair/context_train.py): the producer's
    pretraining or the consumer's fine-tune, on variable-tracking documents of real source."""

    style: str  # question style: "base" (assert x == ) or "expert" (>>> x)
    split: str  # corpus split the excerpts come from (scd_serve/pair/context_corpus.py)
    steps: int
    lr: float
    batch_tokens: int  # about this many tokens per optimizer step
    min_len: int  # document length in tokens, ramped from start_max_len to max_len
    start_max_len: int
    max_len: int
    ramp_frac: float  # fraction of the steps over which lengths and depths grow
    long_frac: float = 0.0  # share of batches drawn up to long_len (length generalization)
    long_len: int = 0
    warmup: int = 50
    chains: tuple[int, int] = (2, 6)  # chains per document; every chain's last name is asked
    start_max_depth: int = 1  # chain depth (additions) grows from this to max_depth over ramp_frac
    max_depth: int = 3
    comment_prob: float = 0.0  # share of chains whose additions carry "# value" (decays to 0)
    comment_until: float = 0.5  # fraction of the steps after which no chain carries comments
    lm_weight: float = 0.1  # loss weight of a scored non-answer token (answer tokens weigh 1)
    lm_frac: float = 0.15  # share of non-answer tokens scored (the 8k-wide head is the costly part)
    copy_frac: float = 0.0  # share of documents that are copy practice: random tokens, then the same again
    copy_vocab: int = 256  # copy practice draws token ids 4 .. 4 + copy_vocab (after the special tokens)
    recall_frac: float = 0.0  # share of documents that are recall practice: chains without code, all asked
    block_frac: float = 0.0  # share of documents that are blocks: one variable at a time, every one asked
    code_frac: float = 0.5  # share of block documents whose filler lines are real code (else `pass`)
    one_name: bool = False  # a chain in an excerpt assigns one name again and again (x = 3 + x)
    # loss weight of a value target: an addition line's last name predicts the ones digit of the
    # line's new value (in place of the newline; in no text), so the value is computed at the line
    value_weight: float = 0.0

    def __post_init__(self):
        check_stage(self)
        if not 0 <= self.start_max_depth <= self.max_depth or not 1 <= self.chains[0] <= self.chains[1]:
            raise ConfigError("stage needs 0 <= start_max_depth <= max_depth and 1 <= chains[0] <= chains[1]")


@dataclass(frozen=True)
class ContextPairConfig:
    """`make-demo-pair --recipe context`: a Qwen2 pair on stdlib source (models/context-pair)."""

    seed: int = 0
    vocab_size: int = 8192
    tokenizer_chars: int = 0  # characters of training text the BPE sees (0: all of base + expert)
    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 8  # head_dim 16: with 4 heads of 32, copying had not formed after 700 steps
    num_kv_heads: int = 4
    intermediate_size: int = 384
    producer_rope_theta: float = 1e4
    consumer_rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    # run 17 (2026-12-02): 2 threads made a long-document step 0.56 s where 1 thread took 1.1 s,
    # so 4,500 of them fit in the 90 minutes (67 min end to end, held-out exact match 0.82; 75 min with
    # run 18's longer expert stage)
    threads: int = 2
    # progressive stacking (scd_serve/pair/grow.py): a shallow_layers-deep model learns the
    # lookup on short documents first, then grows to num_layers; 0 trains num_layers from scratch
    shallow_layers: int = 2
    copy: ContextStageConfig = field(default_factory=lambda: ContextStageConfig(  # copy practice only
        style="base", split="base", steps=200, lr=3e-3, batch_tokens=3072, min_len=64, start_max_len=64,
        max_len=64, ramp_frac=0.0, warmup=20, copy_frac=1.0, copy_vocab=256))
    # then the hop at depth 0 (find the latest line of the variable, read its value): blocks of one
    # variable at a time, every one asked. Probe (2026-12-02, 2 layers): 0.62 of answer digits at
    # step 300, where lookups among many names (recall documents) were at 0.20 after 500.
    shallow: ContextStageConfig = field(default_factory=lambda: ContextStageConfig(
        style="base", split="base", steps=500, lr=2e-3, batch_tokens=2560, min_len=64, start_max_len=192,
        max_len=192, ramp_frac=0.0, warmup=50, chains=(1, 1), start_max_depth=0, max_depth=0, copy_frac=0.15,
        copy_vocab=256, block_frac=0.85, one_name=True))
    # grown: additions (depth 1-2) need a hop per layer; "# value" comments on additions, scored, show
    # each line's value where it must be computed, and fade out slowly (run 8 faded them by half-way,
    # at 400 steps: additions were at 0.30 while the comments lasted, then fell to chance)
    producer: ContextStageConfig = field(default_factory=lambda: ContextStageConfig(
        style="base", split="base", steps=700, lr=1.5e-3, batch_tokens=2560, min_len=128, start_max_len=192,
        max_len=640, ramp_frac=0.6, long_frac=0.05, long_len=2048, warmup=30, chains=(1, 1),
        start_max_depth=1, max_depth=2, comment_prob=0.6, comment_until=0.8, copy_frac=0.05, block_frac=0.7,
        code_frac=0.7, one_name=True))
    # then long documents (384-1,536 tokens, 10% up to 2,048) with value targets: the held-out prompts'
    # lengths. Probes C-X (models/context-pair/README.md) took held-out exact match from 0.08 to 0.83
    # with 6,200 such steps, value targets on in the last 4,600; this stage does it in one, with them
    # on from the start: 3,000 steps gave 0.50 (run 16), 4,500 gave 0.82 (run 17)
    long: ContextStageConfig | None = field(default_factory=lambda: ContextStageConfig(
        style="base", split="base", steps=4500, lr=1e-3, batch_tokens=2560, min_len=384, start_max_len=768,
        max_len=1536, ramp_frac=0.5, long_frac=0.1, long_len=2048, warmup=20, chains=(1, 1),
        start_max_depth=2, max_depth=2, copy_frac=0.05, block_frac=0.2, code_frac=0.7, one_name=True,
        value_weight=1.0))
    # 1,500 expert steps (run 18): held-out exact match 0.93 where 600 gave 0.82. An unsure oracle
    # made top-1 agreement a coin toss on its near-ties, whatever the codec did
    consumer: ContextStageConfig = field(default_factory=lambda: ContextStageConfig(
        style="expert", split="expert", steps=1500, lr=6e-4, batch_tokens=2560, min_len=256, start_max_len=768,
        max_len=1024, ramp_frac=0.2, long_frac=0.15, long_len=2048, warmup=10, chains=(1, 1),
        start_max_depth=2, max_depth=2, block_frac=0.4, code_frac=0.8, one_name=True, value_weight=1.0))
    # the files under eval/: held-out task prompts, plain held-out text, calibration prompts
    eval_lengths: tuple[int, int] = (512, 2048)  # prompt tokens, <bos> included
    eval_depths: tuple[int, int] = (1, 2)  # depth of the asked chain
    eval_chains: tuple[int, int] = (1, 1)
    one_name: bool = True  # the held-out chain assigns one name again and again (x = 3 + x)
    num_heldout: int = 200
    num_text: int = 40
    # 1,024: the codebook calibrated on 960 of them (64 steer the plan) beat 256 prompts'
    # on held-out exact match, 0.833 vs 0.717 (docs/results.md); 256 overfit the distillation
    num_calibration: int = 1024

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if self.shallow_layers < 0 or (self.shallow_layers and self.num_layers % self.shallow_layers):
            raise ConfigError("shallow_layers must be 0 or divide num_layers")
        if self.threads < 1 or self.vocab_size < 300:
            raise ConfigError("threads must be >= 1 and vocab_size >= 300 (bytes + specials)")

    @classmethod
    def text(cls, seed: int = 0) -> "ContextPairConfig":
        """`--recipe text`: a plain language-model pair on the same stdlib source, for measuring a
        codec on real text (issue 17), not the task: every token scored, one depth-0 chain per
        document, the producer from scratch, the consumer fine-tuned on the expert split with
        doctest questions and another rope_theta. About 20 minutes on one CPU thread."""
        lm = dict(min_len=128, start_max_len=512, max_len=512, ramp_frac=0.0, chains=(1, 1), start_max_depth=0,
                  max_depth=0, lm_frac=1.0, lm_weight=1.0, batch_tokens=4096)
        return cls(seed=seed, num_layers=4, num_heads=4, num_kv_heads=2, shallow_layers=0,
                   producer=ContextStageConfig(style="base", split="base", steps=600, lr=2e-3, warmup=30, **lm),
                   consumer=ContextStageConfig(style="expert", split="expert", steps=200, lr=1e-3, warmup=10, **lm),
                   long=None, num_heldout=20, num_calibration=64)

    def shrunk(self) -> "ContextPairConfig":
        """Seconds-long: same code path, a small tokenizer, a tiny model, few short steps."""
        small = dict(steps=3, batch_tokens=512, min_len=64, start_max_len=96, max_len=128, long_frac=0.0,
                     long_len=0, warmup=1, chains=(1, 2))
        return replace(self, vocab_size=1024, tokenizer_chars=400_000, num_layers=2, hidden_size=32, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, threads=1,
                       shallow_layers=1 if self.shallow_layers else 0, copy=replace(self.copy, **small),
                       shallow=replace(self.shallow, **small),
                       producer=replace(self.producer, **small), consumer=replace(self.consumer, **small),
                       long=replace(self.long, **small) if self.long else None,
                       eval_lengths=(128, 384), eval_chains=(2, 3), num_heldout=4, num_text=2, num_calibration=4)
