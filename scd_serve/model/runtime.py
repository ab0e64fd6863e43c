"""ModelRuntime: layer-wise prefill with K/V capture, rotary helpers, recompute, paged KV pool,
extend (prefix-attending chunks) and batched decode steps (model/step.py).

All compute runs under torch.no_grad (not inference_mode) so captured tensors can feed
training code, e.g. the codec's aligner, without a clone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from scd_serve.errors import InvalidRequest, PromptTooLong
from scd_serve.model import cpu_kernel, loader, paged, rope
from scd_serve.model.kv_pool import KVPool
from scd_serve.model.layers import (PackedWeight, attend, causal_mask, finish_layer, linear, project_kv, project_q,
                                    rms_norm)
from scd_serve.model.step import DecodeStep, Step

PACK_FLOAT32_FROM_HIDDEN = 512

Tensor = torch.Tensor
ONE_BLOCK = torch.zeros(1, dtype=torch.long)  # a whole prompt's K/V viewed as block 0 of a pool (cpu_kernel.prefill)


@dataclass
class LayerState:
    keys: Tensor  # [T, kv_heads, head_dim] pre-RoPE (after k_norm for Qwen3)
    values: Tensor  # [T, kv_heads, head_dim]
    attn_input: Tensor  # [T, hidden] after input_layernorm
    # [T, hidden] the layer's input, before input_layernorm; only when asked (residuals=True): most
    # callers keep states per layer, and this is as wide as attn_input
    residual: Tensor | None = None
    start: int = 0  # the prompt position of row 0

    def rows_from(self, start: int, end: int | None = None) -> LayerState:
        """The rows of prompt positions start..end-1 (a transfer after the decode side's cached
        prefix; end: before a row shipped apart, the last-row handoff's)."""
        cut = slice(start - self.start, None if end is None else end - self.start)
        return LayerState(self.keys[cut], self.values[cut], self.attn_input[cut],
                          None if self.residual is None else self.residual[cut], start)


@dataclass
class PrefillOutput:
    logits: Tensor  # [T, vocab] float32
    keys: Tensor | None = None  # [L, T, kv_heads, head_dim] pre-RoPE
    values: Tensor | None = None  # [L, T, kv_heads, head_dim]
    attn_inputs: Tensor | None = None  # [L, T, hidden]


class PrefillIterator:
    """Yields (layer, LayerState) as each layer's K/V are known. Once exhausted, `.logits` holds the
    [T, vocab] float32 logits (also the StopIteration value); None if compute_logits=False, or the
    final row's output [1, hidden] where last_hidden asked for it."""

    def __init__(self, gen: Iterator):
        self._gen = gen
        self.logits: Tensor | None = None

    def __iter__(self) -> PrefillIterator:
        return self

    def __next__(self) -> tuple[int, LayerState]:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.logits = stop.value
            raise

    def close(self) -> None:
        """Stop early: the source's own clean-up runs now (a vLLM producer's engine is freed)."""
        self._gen.close()


class ModelRuntime:
    # iter_prefill(last_hidden=True) gives the final row's output: a prefill worker running the
    # consumer's own model ships the decode side its first step (prefill/service.py)
    computes_last_row = True

    def __init__(self, loaded: loader.Loaded, device: torch.device, dtype: torch.dtype):
        self.path: Path = loaded.path
        self.spec = loaded.spec
        self.fingerprint = loaded.fingerprint
        self.tokenizer = loaded.tokenizer
        self.device = device
        self.dtype = dtype
        self.weights = loaded.weights
        self.rotary = loaded.rotary
        # decode attention through a kernel where one serves (model/paged_kernel.py: CUDA with
        # Triton; model/cpu_kernel.py: the CPU, once a serving role built it); False keeps
        # paged.py's torch path everywhere (benchmarks compare the two)
        self.paged_kernel = True

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: str | torch.dtype = torch.float32, weights: bool = True) -> ModelRuntime:
        """dtype: a torch dtype or a --dtype name ("auto" picks by device). weights=False: the
        model's shapes, rotary and fingerprint only (what a codec that computes nothing with the
        consumer's layers needs, e.g. raw K/V rotated for it): no forward runs."""
        dtype = loader.resolve_dtype(dtype, device)
        loaded = loader.load(path, device, dtype, weights)
        return cls(loaded, torch.device(device), dtype)

    # ---- prefill -------------------------------------------------------------------------
    def prefill(self, input_ids, capture: bool = True) -> PrefillOutput:
        it = self.iter_prefill(input_ids)
        states = [state for _, state in it]
        if not capture:
            return PrefillOutput(logits=it.logits)
        stacked = (torch.stack([getattr(s, name) for s in states]) for name in ("keys", "values", "attn_input"))
        return PrefillOutput(it.logits, *stacked)  # [L, T, ...] each

    def iter_prefill(self, input_ids, compute_logits: bool = True, residuals: bool = False,
                     cached: tuple[KVPool, Sequence[int], int] | None = None,
                     last_hidden: bool = False) -> PrefillIterator:
        """cached: (pool, block_ids, n) where the prompt's first n tokens' K/V are (a prefix
        cache): input_ids are then the rest, computed over that K/V in place (model/step.py,
        their own K/V written after it), and every LayerState has residuals, start n, no logits.
        last_hidden (with compute_logits=False, or cached): the last layer runs for the final row
        alone and the iterator ends with that row's output [1, hidden] (what the output head reads)."""
        ids = self._check_ids(input_ids)
        if cached is not None:
            return PrefillIterator(self._continue(ids, *cached, last_hidden=last_hidden))
        return PrefillIterator(self._prefill_layers(ids, compute_logits, residuals, last_hidden=last_hidden))

    @torch.no_grad()
    def _continue(self, ids: Tensor, pool: KVPool, block_ids: Sequence[int], num_cached: int,
                  last_hidden: bool = False):
        step = self.begin_extend(pool, [(block_ids, num_cached, ids)], "last" if last_hidden else "none")
        for layer in range(self.spec.num_layers):
            h, x, k_pre, v = step.run_layer()  # the rest's rows, [T - n, ...] each
            yield layer, LayerState(k_pre, v, x, h, start=num_cached)
        return step.h[-1:] if last_hidden else None  # the last layer ran for the final row: [1, hidden]

    @torch.no_grad()
    def _prefill_layers(self, ids: Tensor, compute_logits: bool, residuals: bool, first: int = 0,
                        h: Tensor | None = None, last_hidden: bool = False):
        return (yield from self._layers(ids, compute_logits, residuals, first, h, last_hidden))

    def _layers(self, ids: Tensor, compute_logits: bool, residuals: bool, first: int = 0, h: Tensor | None = None,
                last_hidden: bool = False):
        """Layers first.. over the whole prompt, from the residual h [T, hidden] entering `first`
        (None: the token embeddings, first = 0); differentiable unless the caller is not."""
        spec, rot = self.spec, self.rotary
        h = self.weights.embed[ids] if h is None else h  # [T, hidden]
        t = h.shape[0]
        pos = torch.arange(t, device=self.device)
        masks = self._masks(pos[None], torch.tensor([t], device=self.device), t)
        cos, sin = rot.tables(pos)  # once per forward, shared by all layers
        # the CPU's C++ kernels where this process uses them: the norms and SiLU's product, and the
        # attention where it runs vectorized (cpu_kernel.prefill_ops, as model/step.py asks)
        fused = cpu_kernel.ops(self.device, h.dtype) if self.paged_kernel and not torch.is_grad_enabled() else None
        prefill = cpu_kernel.prefill_ops(self.device, h.dtype) if fused is not None else None
        norm = rms_norm if fused is None else fused.rms_norm
        for layer in range(first, spec.num_layers):
            lw = self.weights.layers[layer]
            x = norm(h, lw.ln1, spec.rms_norm_eps)  # [T, hidden]
            k_pre, v = project_kv(lw, spec, x)
            # handed over before the layer's attention and MLP: a caller that needs only K/V
            # stops after the last layer's, and those two are never computed
            yield layer, LayerState(keys=k_pre, values=v, attn_input=x, residual=h if residuals else None)
            if layer == spec.num_layers - 1 and not compute_logits:
                # the last layer's attention and MLP feed only the logits: the final row's, or none
                return self._final_row(lw, h, x, k_pre, v, pos, cos, sin, fused) if last_hidden else None
            q = rope.apply(project_q(lw, spec, x), cos, sin)
            k = rope.apply(k_pre, cos, sin)
            if prefill is not None:  # the prompt's K/V as one block of a pool
                attn = cpu_kernel.prefill(q, k.contiguous()[None], v.contiguous()[None], ONE_BLOCK, 0, spec.window(layer))[None]
            elif paged.bf16_blocks(q):  # bfloat16 on a CPU that multiplies it natively: faster than SDPA
                attn = paged.attend_blocks(q, pos, [(k, v, 0)], spec.window(layer))[None]
            else:
                attn = attend(q[None], k[None], v[None], masks[spec.window(layer)])
            h = finish_layer(lw, spec, h, attn[0], fused)
        return self.logits_of(h) if compute_logits else None

    def _final_row(self, lw, h: Tensor, x: Tensor, k_pre: Tensor, v: Tensor, pos: Tensor, cos: Tensor, sin: Tensor,
                   fused) -> Tensor:
        """The last layer for the prompt's final row: its query over every key -> h [1, hidden]."""
        spec, t = self.spec, h.shape[0]
        q = rope.apply(project_q(lw, spec, x[-1:]), cos[-1:], sin[-1:])  # [1, heads, hd]
        k = rope.apply(k_pre, cos, sin)  # [T, kv_heads, hd]
        window = spec.window(spec.num_layers - 1)
        mask = causal_mask(pos[-1:][None], torch.tensor([t], device=self.device), t, window)  # [1, 1, 1, T]
        return finish_layer(lw, spec, h[-1:], attend(q[None], k[None], v[None], mask)[0], fused)

    def run_from(self, layer: int, residual: Tensor, grad: bool = False) -> PrefillIterator:
        """The prompt's layers layer.. computed here from the residual stream entering `layer`
        ([T, hidden], positions 0..T-1): what the consumer computes from context on its own
        when it runs its upper layers instead of rebuilding them. Yields (layer, LayerState).
        grad: keep the graph back to `residual` (distillation tunes the map that made it)."""
        self._check_layer(layer)
        if residual.dim() != 2 or residual.shape[1] != self.spec.hidden_size:
            raise InvalidRequest(f"residual must be [T, {self.spec.hidden_size}], got {tuple(residual.shape)}")
        layers = self._layers if grad else self._prefill_layers
        return PrefillIterator(layers(None, False, False, layer, residual.to(self.device, self.dtype)))

    @torch.no_grad()
    def token_inputs(self, input_ids) -> Tensor:
        # input_ids: [T] -> layer 0's attention input [T, hidden] float32 (token ids alone fix it)
        ids = self._check_ids(input_ids)
        return rms_norm(self.weights.embed[ids], self.weights.layers[0].ln1, self.spec.rms_norm_eps).float()

    @torch.no_grad()
    def token_states(self, input_ids, chunk: int = 1024, layers: int | None = None) -> Tensor:
        # input_ids: [U] -> [U, layers * 2 * kv_width] float32: each token's pre-RoPE K and V at its
        # first `layers` layers (None: all) when it stands alone, so attention's output is its own V
        # (token ids alone fix these rows; the pass costs a prefill of U tokens without attention)
        ids = self._check_ids(input_ids)
        spec, out = self.spec, []
        for start in range(0, ids.shape[0], chunk):  # bounded activations for long id lists
            h, rows = self.weights.embed[ids[start: start + chunk]], []  # [u, hidden]
            for lw in self.weights.layers[:layers]:
                k, v = project_kv(lw, spec, rms_norm(h, lw.ln1, spec.rms_norm_eps))  # [u, kv_heads, hd]
                rows += [k.flatten(1), v.flatten(1)]
                h = finish_layer(lw, spec, h, v.repeat_interleave(spec.num_heads // spec.num_kv_heads, 1).flatten(1))
            out.append(torch.cat(rows, 1).float())
        return torch.cat(out)

    # ---- K/V helpers ---------------------------------------------------------------------
    @torch.no_grad()
    def rotate_keys(self, k_pre: Tensor, positions: Tensor) -> Tensor:
        # k_pre: [T, kv_heads, head_dim], positions: [T] -> post-RoPE keys with this model's rotary
        self._check_kv_shape("k_pre", k_pre)
        if positions.shape != k_pre.shape[:1]:
            raise InvalidRequest(f"positions must have shape [{k_pre.shape[0]}], got {tuple(positions.shape)}")
        return self.rotary.rotate(k_pre.to(self.device, self.dtype), positions)

    @torch.no_grad()
    def unrotate_keys(self, k_rot: Tensor, positions: Tensor) -> Tensor:
        self._check_kv_shape("k_rot", k_rot)
        return self.rotary.unrotate(k_rot.to(self.device, self.dtype), positions)

    @torch.no_grad()
    def recompute_kv(self, layer: int, attn_input: Tensor) -> tuple[Tensor, Tensor]:
        # attn_input: [T, hidden] -> (k_pre, v): [T, kv_heads, head_dim]
        self._check_layer(layer)
        if attn_input.dim() != 2 or attn_input.shape[1] != self.spec.hidden_size:
            raise InvalidRequest(f"attn_input must be [T, {self.spec.hidden_size}], got {tuple(attn_input.shape)}")
        return project_kv(self.weights.layers[layer], self.spec, attn_input.to(self.device, self.dtype))

    # ---- paged KV pool -------------------------------------------------------------------
    def new_kv_pool(self, num_blocks: int, block_size: int) -> KVPool:
        s = self.spec
        return KVPool.allocate(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.device, self.dtype)

    @torch.no_grad()
    def write_kv(self, pool: KVPool, block_ids: Sequence[int], layer: int, k_pre: Tensor, v: Tensor, start: int = 0) -> None:
        # k_pre, v: [T, kv_heads, head_dim] for positions start..start+T-1; keys rotated here
        self.kv_writer(pool, block_ids, k_pre.shape[0], start).write(layer, k_pre, v)

    @torch.no_grad()
    def kv_writer(self, pool: KVPool, block_ids: Sequence[int], num_tokens: int, start: int = 0) -> "KVWriter":
        """write_kv for every layer of one request: its slots and rotary tables are computed
        here once, not per layer (a rebuild writes each of the request's layers in turn)."""
        return KVWriter(self, pool, pool.slots(block_ids, start, num_tokens),
                        self.rotary.tables(torch.arange(start, start + num_tokens, device=self.device)))

    def extend(self, pool: KVPool, items: Sequence[tuple[Sequence[int], int, Tensor]],
               logits: str | Sequence[str] = "all") -> list[Tensor | None]:
        """Each item's new tokens over its cached prefix, K/V written to the pool, in one forward.
        items: (block_ids, num_cached, tokens [n]) -> per item, by `logits` (one for all or one
        per item): "all" [n, vocab] float32, "last" [1, vocab], "none" None. Ask only for the
        rows you read: at a real vocabulary the head costs as much as several layers."""
        return self.begin_extend(pool, items, logits).logits()

    def begin_extend(self, pool: KVPool, items: Sequence[tuple[Sequence[int], int, Tensor]],
                     logits: str | Sequence[str] = "all") -> Step:
        """`extend` as a Step whose layers the caller runs (`run_layer`, `resume`), then `logits()`."""
        wants = [logits] * len(items) if isinstance(logits, str) else list(logits)
        return Step(self, pool, items, wants)

    def decode_step(self, pool: KVPool, items: Sequence[tuple[Sequence[int], int, int]]) -> Tensor:
        """One token for each of B sequences in ONE batched forward.
        items: (block_ids, num_cached, token_id) -> logits [B, vocab] float32."""
        return DecodeStep(self, pool, items).logits()

    def begin_decode_step(self, pool: KVPool, items: Sequence[tuple[Sequence[int], int, int]]) -> DecodeStep:
        """decode_step, to be run a layer at a time (DecodeStep.run_layer, then .logits())."""
        return DecodeStep(self, pool, items)

    def mixed_step(self, pool: KVPool, chunks: Sequence[tuple[Sequence[int], int, Tensor]], chunk_logits: Sequence[str],
                   decodes: Sequence[tuple[Sequence[int], int, int]]) -> tuple[list[Tensor | None], Tensor | None]:
        """Prefill chunks (as extend) and decode tokens (as decode_step) in one forward: the
        weights are read once for both. -> (per chunk its logits, decode logits [B, vocab] or None)."""
        items = [*chunks, *((b, c, [int(t)]) for b, c, t in decodes)]
        out = Step(self, pool, items, [*chunk_logits, *["last"] * len(decodes)]).logits()
        return out[:len(chunks)], (torch.cat(out[len(chunks):]) if decodes else None)

    # ---- convenience ---------------------------------------------------------------------
    def generate_greedy(self, input_ids, max_new_tokens: int, eos_token_id: int | None = None, block_size: int = 16) -> list[int]:
        """Greedy continuation through the pool (extend for the prompt, then decode_step)."""
        ids = self._check_ids(input_ids)
        t, limit = ids.shape[0], self.spec.max_position_embeddings
        if max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if t + max_new_tokens > limit:
            raise PromptTooLong(f"prompt of {t} tokens + {max_new_tokens} new tokens = {t + max_new_tokens} exceeds "
                                f"the model's context of {limit} positions (max_position_embeddings)")
        if max_new_tokens == 0:
            return []
        num_blocks = -(-(t + max_new_tokens) // block_size)
        pool, blocks = self.new_kv_pool(num_blocks, block_size), list(range(num_blocks))
        token = int(self.extend(pool, [(blocks, 0, ids)], logits="last")[0][-1].argmax())
        out = [token]
        while len(out) < max_new_tokens and token != eos_token_id:
            token = int(self.decode_step(pool, [(blocks, t + len(out) - 1, token)])[0].argmax())
            out.append(token)
        return out

    def pack_linears(self) -> bool:
        """For serving on a CPU (float32 weights of a model of hidden size 512 or more, or bfloat16
        where the CPU has it natively): every layer's linear weights reordered once into oneDNN's
        layout (layers.PackedWeight). Not for autograd (calibration differentiates through the
        layers): the serving roles call it at start. -> whether it packed."""
        # float32 from hidden 512 on: below it oneDNN's ~10 us a call costs more than BLAS's
        # unpacked matmul takes at decode sizes (layers.PackedWeight)
        wanted = ((self.dtype == torch.float32 and self.spec.hidden_size >= PACK_FLOAT32_FROM_HIDDEN)
                  or (self.dtype == torch.bfloat16 and loader.cpu_has_native_bf16()))
        if not (self.device.type == "cpu" and wanted and torch.backends.mkldnn.is_available()):
            return False
        for lw in self.weights.layers:
            for name in ("wq", "wkv", "wo", "w_gate_up", "w_down"):
                if not isinstance(getattr(lw, name), PackedWeight):
                    setattr(lw, name, PackedWeight(getattr(lw, name)))
        # the output head too: at [151936, 896] it is the largest matmul of a decode step (a bfloat16
        # step of 8 sequences, one thread: 77 -> 66 ms); a tied head is packed as a copy of the
        # embedding, which the token lookup still reads (vocab x hidden more bytes)
        if not isinstance(self.weights.lm_head, PackedWeight):
            self.weights.lm_head = PackedWeight(self.weights.lm_head)
        return True

    def logits_of(self, h: Tensor) -> Tensor:
        """h [N, hidden] (last layer's output) -> [N, vocab] float32: the final norm and the head."""
        w = self.weights
        return linear(rms_norm(h, w.norm, self.spec.rms_norm_eps), w.lm_head, None).float()

    # ---- internals -----------------------------------------------------------------------

    def _masks(self, q_pos: Tensor, lengths: Tensor, s: int) -> dict:
        """window -> [B, 1, Tq, S] bool mask (None for full causal square attention)."""
        windows = {self.spec.window(i) for i in range(self.spec.num_layers)}
        return {w: (causal_mask(q_pos, lengths, s, w) if w is not None else None) for w in windows}

    def _check_ids(self, input_ids, offset: int = 0) -> Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequest(f"input_ids must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)} {ids.dtype}")
        total, limit = offset + ids.numel(), self.spec.max_position_embeddings
        if total > limit:
            raise PromptTooLong(f"{total} positions exceed the model's context of {limit} (max_position_embeddings)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise InvalidRequest(f"token ids must lie in 0..{self.spec.vocab_size - 1}")
        return ids.to(self.device, torch.long)

    def _check_kv_shape(self, name: str, k: Tensor) -> None:
        want = (self.spec.num_kv_heads, self.spec.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != want:
            raise InvalidRequest(f"{name} must be [T, {want[0]}, {want[1]}], got {tuple(k.shape)}")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidRequest(f"layer {layer} out of range 0..{self.spec.num_layers - 1}")


class KVWriter:
    """Writes one request's K/V for positions start..start+T-1, a layer at a time."""

    def __init__(self, runtime: ModelRuntime, pool: KVPool, slots: Tensor, cos_sin: tuple[Tensor, Tensor]):
        self.rt, self.pool = runtime, pool
        self.slots = slots  # [T] flat pool slots
        self.cos, self.sin = cos_sin  # [T, 1, head_dim] each

    @torch.no_grad()
    def write(self, layer: int, k_pre: Tensor, v: Tensor) -> None:
        # k_pre, v: [T, kv_heads, head_dim]; keys pre-RoPE, rotated here with the consumer's tables
        rt = self.rt
        rt._check_layer(layer)
        rt._check_kv_shape("k_pre", k_pre)
        if v.shape != k_pre.shape:
            raise InvalidRequest(f"v must have the shape of k_pre {tuple(k_pre.shape)}, got {tuple(v.shape)}")
        if k_pre.shape[0] != self.slots.shape[0]:
            raise InvalidRequest(f"k_pre has {k_pre.shape[0]} positions; this writer covers {self.slots.shape[0]}")
        k_rot = rope.apply(k_pre.to(rt.device, rt.dtype), self.cos, self.sin)
        self.pool.write(layer, self.slots, k_rot, v.to(rt.device))
