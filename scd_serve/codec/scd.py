"""SCD codecs: `reuse` (low-rank shared codes), `scd` (reuse + patches), `scd-int8`.

Reuse layer: the producer sends z_k = (k_pre,A - mu_a) Enc_k[:, :r_k] and likewise z_v; the
consumer rebuilds k_pre,B = z_k Dec_B + mu_b (pre-RoPE; write_kv applies the consumer's RoPE).
Patch layer: the producer sends z_h = (H_in,A - mu_a) Enc_h; the consumer maps it with its
aligner g to its own H_in,B and recomputes the layer's K/V with its own weights.
Run (plan.py): the producer sends z_r of its residual entering the run's first layer; the
consumer maps it to its own residual and runs that layer and all above over the prompt.
Codes ship as fp16, or as int8 with one fp16 scale per code channel (absmax over the tokens).
Where the codebook has a token prior (features.py, or prior.py's dense tables), the consumer
adds prior(prompt tokens) to each rebuilt stream; the codes carry only the rest.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from scd_serve.codec.base import STREAM_STATES, check_code, state_field, to_consumer
from scd_serve.codec.codebook import Codebook
from scd_serve.codec.lowrank import Aligner
from scd_serve.codec.plan import OWN, REUSE, RUN, LayerPlan, Plan
from scd_serve.codec.rebuild import Rebuild
from scd_serve.codec.refiner import Refiner
from scd_serve.codec.reuse import ReuseDecoder
from scd_serve.errors import CodebookError


def quantize_int8(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z: [T, r] -> int8 codes [T, r] and per-channel fp16 scales [r]."""
    scale = (z.abs().amax(dim=0) / 127.0).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(z / scale.float()).clamp(-127, 127).to(torch.int8), scale


class ScdCodec:
    """One plan of a codebook, with 16-bit or int8 codes.

    codes=False is the zero-payload ablation `prior-only`: every layer rebuilt from the
    consumer's means and token priors (where the codebook has them) alone (the Reuse plan's
    tensors), nothing shipped. replay_tokens: the prompt's last tokens the consumer computes
    itself (codec/base.py), head_tokens its first (codec/rebuild.py): the codebook's choices for
    its scd plan."""

    def __init__(self, name: str, codebook: Codebook, plan: Plan, int8: bool = False,
                 dtype: torch.dtype = torch.float16, codes: bool = True, replay_tokens: int = 0,
                 head_tokens: int = 0):
        self.name = name
        self.version = f"{name}/{codebook.manifest.get('version')}/{codebook.manifest.get('tensors_sha256', '')[:12]}"
        self.codebook, self.plan, self.int8, self.dtype, self.codes = codebook, plan, int8, dtype, codes
        self.replay_tokens, self.head_tokens = replay_tokens, head_tokens
        # for the serving handshake: which codebook, and which models it was fitted for
        self.codebook_id = codebook.manifest.get("tensors_sha256", "")[:16]
        self.producer_fingerprint = codebook.side_spec("producer").fingerprint or ""
        self.consumer_fingerprint = codebook.side_spec("consumer").fingerprint or ""
        self._enc: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._dec: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._aligners: dict[int, Aligner] = {}
        self._refiners: dict[tuple[int, str, int], Refiner | None] = {}
        self._priors: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._reuse: dict[tuple, ReuseDecoder] = {}  # (layer, stream, rank, device) -> its folded decode
        self._context_prior = codebook.context_prior()
        self._features = getattr(self._context_prior, "kind", None) == "features"  # float features, folded in
        self.inputs = codebook.code_inputs()  # stream -> the stream whose producer state its code reads

    def states_needed(self, layer: int) -> frozenset[str]:
        return frozenset(STREAM_STATES[self.inputs[s]] for s, _ in self.plan.layers[layer].streams)

    # ---- producer ------------------------------------------------------------------------
    def _encoder(self, layer: int, s: str, rank: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, s)
        if key not in self._enc:
            p = f"layers.{layer}.{s}"
            enc = self.codebook.tensor(f"{p}.enc")[:, :rank]
            self._enc[key] = (self.codebook.tensor(f"{p}.mu_a").to(like.device, torch.float32),
                              enc.to(like.device, torch.float32).contiguous())
        return self._enc[key]

    def _pack(self, name: str, z: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.int8:
            return {name: z.to(self.dtype)}
        q, scale = quantize_int8(z)
        return {name: q, f"{name}_scale": scale}

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        lp = self.plan.layers[layer]
        if not self.codes:
            return {}
        code: dict[str, torch.Tensor] = {}
        for s, rank in lp.streams:
            x = state_field(state, STREAM_STATES[self.inputs[s]]).float()
            x = x.reshape(x.shape[0], -1)  # [T, d]
            mu, enc = self._encoder(layer, s, rank, x)
            code.update(self._pack(f"z{s}", (x - mu) @ enc))  # z: [T, r]
        return check_code(code)

    # ---- consumer ------------------------------------------------------------------------
    def _unpack(self, code: Mapping[str, torch.Tensor], name: str, consumer: Any) -> torch.Tensor:
        z = to_consumer(code[name], consumer)
        if self.int8:
            z = z * to_consumer(code[f"{name}_scale"], consumer)
        return z

    def _decoder(self, layer: int, s: str, rank: int, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(Dec_B [rank, dB], or None for a rank-0 stream; mu_b [dB])."""
        key = (layer, s)
        if key not in self._dec:
            p = f"layers.{layer}.{s}"
            self._dec[key] = (self.codebook.tensor(f"{p}.dec.r{rank}").to(device, torch.float32) if rank else None,
                              self.codebook.tensor(f"{p}.mu_b").to(device, torch.float32))
        return self._dec[key]

    def refiner(self, layer: int, s: str, rank: int, device: torch.device) -> Refiner | None:
        """The refiner a rank-`rank` code of Reuse stream s is decoded with, or None."""
        key = (layer, s, rank)
        if key not in self._refiners:
            found = self.codebook.refiner(layer, s, rank)
            self._refiners[key] = found and found.to(device)
        return self._refiners[key]

    def plan_refiners(self, device: torch.device) -> dict[tuple[int, str, int], Refiner]:
        """(layer, stream, rank) -> the refiner each Reuse stream the plan ships is decoded with."""
        return {(i, s, r): ref for i, lp in enumerate(self.plan.layers) if lp.mode == REUSE for s, r in lp.decoded
                if r and (ref := self.refiner(i, s, r, device)) is not None}

    def _aligner(self, layer: int, s: str, rank: int, device) -> Aligner:
        if layer not in self._aligners:
            self._aligners[layer] = self.codebook.aligner(layer, s, rank).to(device)
        return self._aligners[layer]

    def _prior(self, layer: int, s: str, rebuild: "ScdRebuild", like: torch.Tensor) -> torch.Tensor | float:
        """The token prior of stream s for the prompt's tokens: [T, dB], or 0 without one."""
        key = (layer, s, like.device)
        if key not in self._priors:
            found = self.codebook.prior_tensors(layer, s)
            self._priors[key] = found and tuple(t.to(like.device, torch.float32) for t in found)
        if self._priors[key] is None:
            return 0.0
        return self._context_prior.apply(*self._priors[key], rebuild.context(like))

    @property
    def rows_decode_alone(self) -> bool:
        """Whether rows start.. decode without the rows before them (codec/rebuild.py): not with
        a run, which is the consumer's forward over the whole prompt."""
        return self.plan.run_layer is None

    def begin(self, tokens: Any, consumer: Any, start: int = 0) -> "ScdRebuild":
        """One prompt's rebuild (codec/rebuild.py): tokens, its prompt's token ids [T] (needed
        where the codebook has token priors, own layers or a run); rows start.. are decoded."""
        if start and not self.rows_decode_alone:
            raise CodebookError(f"codebook '{self.codebook_id}' has a run: its rebuild starts at the prompt's "
                                f"first token, not {start}")
        return ScdRebuild(self, tokens, consumer, start)

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer alone (a run's layers above its first, and token priors after a cached
        prefix, need the prompt's Rebuild: `begin`). tokens: the rows' ids."""
        if start and self._context_prior is not None:
            raise CodebookError("token priors read the tokens before the first row: decode through begin()")
        return self.begin(tokens, consumer).decode_layer(layer, code)

    def decoder_inputs(self, layer: int, code: Mapping[str, torch.Tensor], rebuild: "ScdRebuild",
                       lp: LayerPlan | None = None, refine: bool = True
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a layer's decode combines with its decoder or aligner (distill.py tunes those):
        -> ({stream: code [T, r] as received}, {stream decoded: what is added to its decoder's or
        aligner's output: token prior and a Reuse stream's refiner [T, dB], or 0.0}); a rank-0
        stream has no code. lp: the layer's plan (default: the codec's). refine=False leaves the
        refiners out (distillation tunes them too)."""
        lp = lp or self.plan.layers[layer]
        codes = {s: self._unpack(code, f"z{s}", rebuild.consumer) for s, _ in lp.streams}
        for z in codes.values():
            rebuild.check_rows(z)
        like = next(iter(codes.values()), None)
        if like is None and lp.decoded:
            like = to_consumer(torch.empty(rebuild.num_tokens(layer), 0), rebuild.consumer)  # [T, 0]
        added = {s: self._prior(layer, s, rebuild, codes.get(s, like)) for s, _ in lp.decoded}
        for s, rank in lp.decoded if lp.mode == REUSE and refine else ():
            refiner = self.refiner(layer, s, rank, like.device) if rank else None  # rank 0: the linear prior alone
            if refiner is not None:
                with torch.no_grad():
                    added[s] = added[s] + refiner(codes[s], rebuild.context(codes[s]))
        return codes, added

    def _decode(self, layer: int, code: Mapping[str, torch.Tensor], rebuild: "ScdRebuild"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        lp, consumer = self.plan.layers[layer], rebuild.consumer
        if not self.codes and lp.mode != OWN:  # prior-only: every layer its streams' priors alone
            lp = LayerPlan(REUSE)  # (an own layer is zero payload already: computed as in the plan)
        if lp.mode == OWN:  # layer 0 from the consumer's own embeddings of the prompt: exact
            return own_kv(consumer, layer, rebuild.token_ids(layer))
        if lp.mode == REUSE:
            return self._reuse_kv(layer, code, rebuild, lp)
        codes, priors = self.decoder_inputs(layer, code, rebuild, lp)  # codes: {stream: [T, r]}
        if lp.mode == RUN:
            return rebuild.run_layer(layer, codes, priors)
        z = codes["h"]
        with torch.no_grad():
            h = self._aligner(layer, "h", lp.r_h, z.device)(z) + priors["h"]  # [T, hidden] H_in,B
        return consumer.recompute_kv(layer, h.to(consumer_dtype(consumer)))

    def _reuse_kv(self, layer: int, code: Mapping[str, torch.Tensor], rebuild: "ScdRebuild", lp: LayerPlan
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A Reuse layer's (k_pre, v) through each stream's folded decode (codec/reuse.py): the
        same sum decoder_inputs and the decoder make, in two matrix products a stream."""
        spec, consumer = self.codebook.side_spec("consumer"), rebuild.consumer
        codes = {s: self._unpack(code, f"z{s}", consumer) for s, _ in lp.streams}  # {stream: [T, r]}
        for z in codes.values():
            rebuild.check_rows(z)
        like = next(iter(codes.values()), None)
        n = like.shape[0] if like is not None else rebuild.num_tokens(layer)
        if like is None:
            like = to_consumer(torch.empty(n, 0), consumer)
        ctx = rebuild.context(like) if self._features else None
        out = []
        for s, rank in lp.decoded:
            b = self._reuse_decoder(layer, s, rank, like.device)(codes.get(s), ctx, n)  # [T, dB]
            if ctx is None and self._context_prior is not None:  # a dense prior: a table gather, not folded
                b = b + self._prior(layer, s, rebuild, like)
            out.append(b.reshape(n, spec.num_kv_heads, spec.head_dim))
        return out[0], out[1]

    def _reuse_decoder(self, layer: int, s: str, rank: int, device: torch.device) -> ReuseDecoder:
        key = (layer, s, rank, device)
        if key not in self._reuse:
            dec, mu = self._decoder(layer, s, rank, device)
            found = self.codebook.prior_tensors(layer, s) if self._features else None
            prior = found and tuple(t.to(device, torch.float32) for t in found)
            self._reuse[key] = ReuseDecoder(dec, mu, prior, self.refiner(layer, s, rank, device) if rank else None)
        return self._reuse[key]


class ScdRebuild(Rebuild):
    """One prompt through an ScdCodec: its token context, computed once for every layer, and a
    run's forward, held from the run's first layer to its last (they decode in order)."""

    def __init__(self, codec: ScdCodec, tokens: Any, consumer: Any, start: int = 0):
        super().__init__(codec, tokens, consumer, start)
        self._context: tuple[torch.device, torch.Tensor] | None = None
        self._run: Any = None  # the consumer's forward from the run's first layer (model.run_from)
        self._checked = -1  # the row count check_rows last found the prompt's tokens to match

    def prepare(self) -> None:
        """The prior's context, while the codes are on their way."""
        if self.codec._context_prior is not None and self.tokens is not None:
            self.context(to_consumer(torch.empty(len(self.tokens) - self.start, 0), self.consumer))

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec._decode(layer, code, self)

    def check_rows(self, like: torch.Tensor) -> None:
        """Refuse a code of another row count than the prompt's tokens (where given), once a prompt."""
        if self._checked != like.shape[0]:
            check_token_count(self.rows, like)
            self._checked = like.shape[0]

    def token_ids(self, layer: int) -> Any:
        if self.tokens is None:
            raise CodebookError(f"codebook '{self.codec.codebook_id}' decodes layer {layer} from the prompt's "
                                "token ids: pass tokens=")
        return self.rows

    def num_tokens(self, layer: int) -> int:
        return torch.as_tensor(self.token_ids(layer)).numel()

    def context(self, like: torch.Tensor) -> torch.Tensor:
        """The prior's context of the decoded rows (token ids [T, taps] or features [T, rank]) on
        like's device, made from the whole prompt (a row's context reads the tokens before it)."""
        if self._context is None or self._context[0] != like.device:
            if self.tokens is None:
                raise CodebookError(f"codebook '{self.codec.codebook_id}' decodes with token priors: "
                                    "decode_layer needs the prompt's token ids (tokens=)")
            check_token_count(self.rows, like)
            ids = torch.as_tensor(self.tokens).reshape(-1)
            context = self.codec._context_prior.context(ids, self.consumer, device=like.device)
            self._context = (like.device, context[self.start:])
        return self._context[1]

    def run_layer(self, layer: int, codes: dict[str, torch.Tensor], priors: dict[str, Any]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A run's layer: the first maps the residual code and starts the consumer's own forward
        from it; each layer above takes its next layer."""
        self.token_ids(layer)  # a run is computed per prompt
        if "r" in codes:
            with torch.no_grad():  # [T, hidden] the consumer's residual entering `layer`
                lp = self.codec.plan.layers[layer]
                h = self.codec._aligner(layer, "r", lp.r_h, codes["r"].device)(codes["r"]) + priors["r"]
            self._run = self.consumer.run_from(layer, h)
        elif self._run is None:
            raise CodebookError(f"layer {layer} is computed by a run whose first layer "
                                f"({self.codec.plan.run_layer}) was not decoded for this prompt")
        at, state = next(self._run)
        if at != layer:
            raise CodebookError(f"the run is at layer {at}, decode_layer asked for {layer}: a run decodes in order")
        if layer == len(self.codec.plan.layers) - 1:
            self._run = None
        return state.keys, state.values


def check_token_count(tokens: Any, like: torch.Tensor) -> torch.Tensor | None:
    """The prompt's token ids [T] when given, refused unless they match the code's T rows."""
    if tokens is None:
        return None
    ids = torch.as_tensor(tokens).reshape(-1)
    if ids.shape[0] != like.shape[0]:
        raise CodebookError(f"decode_layer got {ids.shape[0]} token ids for a code of {like.shape[0]} tokens")
    return ids


def consumer_dtype(consumer: Any) -> torch.dtype:
    dtype = getattr(consumer, "dtype", torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def own_kv(consumer: Any, layer: int, tokens: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An own layer's K/V (plan.py): the consumer's projections of its own layer-0 input. -> [T, kvh, hd] x2"""
    h = consumer.token_inputs(torch.as_tensor(tokens).reshape(-1))  # [T, hidden]
    return consumer.recompute_kv(layer, h.to(consumer_dtype(consumer)))
