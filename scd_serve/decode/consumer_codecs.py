"""The consumer halves of the transfer codecs, one per (producer, method), built on demand
from the producer's shape and rotary facts as its handshake reports them, plus the codebook."""

from __future__ import annotations

from scd_serve import codec as codec_registry
from scd_serve.codec.codebook import Codebook, codebook_arg
from scd_serve.errors import ScdError


def producer_spec(info) -> dict:
    """InfoReply -> the dict codec.codec_spec.spec_of() reads."""
    return {"num_layers": info.num_layers, "hidden_size": info.hidden_size, "num_kv_heads": info.num_kv_heads,
            "head_dim": info.head_dim, "rope_theta": info.rope_theta, "fingerprint": info.producer_fingerprint}


class ConsumerCodecs:
    def __init__(self, runtime, codebook: str = ""):
        self.rt = runtime
        self.codebook = codebook_arg(codebook)
        self._book = None  # the loaded Codebook, one for every method: they share its token prior
        self._built: dict[tuple[str, str], object] = {}

    def loaded_codebook(self):
        """The codebook, loaded once and checked against this consumer; None without one."""
        if self._book is None and self.codebook is not None:
            self._book = Codebook.load(self.codebook, consumer=self.rt)
        return self._book

    def get(self, info, method: str):
        """The codec for `method` against the producer described by `info`; raises ScdError."""
        key = (info.producer_fingerprint, method)
        c = self._built.get(key)
        if c is None:
            book = self.loaded_codebook() if method in codec_registry.NEEDS_CODEBOOK else self.codebook
            c = codec_registry.build(method, producer=producer_spec(info), consumer=self.rt, codebook=book)
            self._built[key] = c
        return c

    def fill_prior_table(self, mode: str, budget_s: float) -> str | None:
        """The feature prior's vocabulary table (codec/prior_table.py) on this consumer's device;
        -> what was done, or None without a codebook or a feature prior."""
        from scd_serve.codec import prior_table

        book = self.loaded_codebook()
        return prior_table.fill_codebook(book, self.rt, mode, budget_s) if book is not None else None

    def can_build(self, info, method: str) -> str:
        """'' if the codec builds, else why not (for handshake messages)."""
        try:
            self.get(info, method)
            return ""
        except (ScdError, ValueError, KeyError, OSError) as exc:
            return f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
