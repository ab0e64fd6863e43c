"""Transfer codecs: how a layer's KV state travels from the producer to the consumer.

    codec = build("raw", producer=rt_a, consumer=rt_b)      # runtimes or their specs
    code = codec.encode_layer(layer, state)                 # producer: dict[str, Tensor]
    rebuild = begin(codec, ids, rt_b)                        # consumer, one per prompt
    k_pre, v = rebuild.decode_layer(layer, code)            # then rt_b.write_kv

`METHODS` lists the names `build` accepts. The producer can build its half with specs only
(the codebook carries the producer encoders); the consumer passes its runtime to decode.
"""

from __future__ import annotations

from typing import Any

from scd_serve.codec.base import (ATTN_INPUT, KEYS, VALUES, TransferCodec, payload_bytes, transferred,
                                  wants_residuals)
from scd_serve.codec.baselines import IdentityCodec, RawCodec
from scd_serve.codec.droidspeak import DroidSpeakCodec
from scd_serve.codec.codebook import Codebook, as_codebook
from scd_serve.codec.quant import QuantCodec
from scd_serve.codec.rebuild import Rebuild, begin, codes_from
from scd_serve.codec.scd import ScdCodec
from scd_serve.config import methods
from scd_serve.errors import ConfigError

_FACTORIES = {
    "identity": lambda producer, consumer, codebook: IdentityCodec(producer, consumer),
    "raw": lambda producer, consumer, codebook: RawCodec(producer, consumer),
    "quant4": lambda producer, consumer, codebook: QuantCodec(producer, bits=4),
    "quant2": lambda producer, consumer, codebook: QuantCodec(producer, bits=2),
    "droidspeak": lambda producer, consumer, codebook: _droidspeak(producer, consumer, codebook),
    "reuse": lambda producer, consumer, codebook: _scd("reuse", producer, consumer, codebook),
    "scd": lambda producer, consumer, codebook: _scd("scd", producer, consumer, codebook),
    "scd-int8": lambda producer, consumer, codebook: _scd("scd-int8", producer, consumer, codebook),
    "prior-only": lambda producer, consumer, codebook: _scd("prior-only", producer, consumer, codebook),
}
# methods that cannot work without a calibrated codebook
NEEDS_CODEBOOK = frozenset({"reuse", "scd", "scd-int8", "prior-only"})
# methods whose decode side computes with the consumer's own weights (token prior, Patch, runs,
# DroidSpeak's recomputed layers); the others need its shapes and rotary only
NEEDS_CONSUMER_WEIGHTS = NEEDS_CODEBOOK | {"droidspeak"}


def _droidspeak(producer: Any, consumer: Any, codebook: Any) -> DroidSpeakCodec:
    """Recompute layers chosen by calibration when a codebook is given, else a default set."""
    if codebook is None:
        return DroidSpeakCodec(producer)
    book = as_codebook(codebook, producer, consumer)
    ds = DroidSpeakCodec(producer, book.droidspeak_layers)
    ds.codebook_id = book.manifest.get("tensors_sha256", "")[:16]
    return ds


def _scd(method: str, producer: Any, consumer: Any, codebook: Any) -> ScdCodec:
    """The scd plan's codecs compute the head and replay the tail calibration chose for it; so
    does prior-only, its zero-payload control (the two then differ only in the codes); reuse, the
    ablation, does not."""
    book = as_codebook(codebook, producer, consumer)
    own = {"replay_tokens": replayed(method, book), "head_tokens": headed(method, book)}
    if method == "prior-only":
        return ScdCodec(method, book, book.plan("reuse"), codes=False, **own)
    return ScdCodec(method, book, book.plan(_plan_name(method, book)), int8=method.endswith("int8"), **own)


def _plan_name(method: str, book: Codebook) -> str:
    return method if method in book.manifest.get("plans", {}) or method != "scd-int8" else "scd"


def replayed(method: str, book: Codebook | None) -> int:
    """The prompt's last handed-off tokens the consumer computes itself under `method` with this
    codebook (codec/base.py): the scd plan's replayed tail (prior-only's too), else 0. Read
    from the manifest alone, so a vLLM scheduler counts them without loading the tensors."""
    return book.replay_tokens if _has_scd_plan(method, book) else 0


def headed(method: str, book: Codebook | None) -> int:
    """The prompt's first tokens the consumer computes itself under `method` (codec/rebuild.py):
    the scd plan's head (prior-only's too), else 0."""
    return book.head_tokens if _has_scd_plan(method, book) else 0


def _has_scd_plan(method: str, book: Codebook | None) -> bool:
    return book is not None and method in NEEDS_CODEBOOK and (method == "prior-only"
                                                               or _plan_name(method, book) == "scd")

# What serving offers; ABLATIONS are built by name for the eval table only (config/methods.py).
ABLATIONS: list[str] = list(methods.ABLATIONS)
METHODS: list[str] = list(methods.TRANSFER_METHODS)
if set(_FACTORIES) != {*METHODS, *ABLATIONS}:  # a codec added here must be named in the vocabulary
    raise ImportError(f"codec registry {sorted(_FACTORIES)} differs from config/methods.py's vocabulary")


def build(method: str, producer: Any = None, consumer: Any = None, codebook: Any = None) -> TransferCodec:
    """Make the codec called `method`. codebook: a directory, a loaded Codebook, or None."""
    factory = _FACTORIES.get(method)
    if factory is None:
        raise ConfigError(f"unknown transfer method '{method}'; choose one of {', '.join(METHODS)}")
    if producer is None and method != "identity":
        raise ConfigError(f"method '{method}' needs the producer (a runtime or its spec)")
    return factory(producer, consumer, codebook)


__all__ = ["METHODS", "ABLATIONS", "NEEDS_CODEBOOK", "NEEDS_CONSUMER_WEIGHTS", "build", "replayed", "headed", "begin", "codes_from", "Rebuild", "payload_bytes", "transferred", "wants_residuals", "Codebook", "TransferCodec",
           "KEYS", "VALUES", "ATTN_INPUT"]
