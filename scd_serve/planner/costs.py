"""Per-request payload and compute of each transfer method, for a model shape.

The planner's counting rules, following the method note (docs/scd-method.md):
  raw         K and V of every layer in 16 bit
  quant4/2    KIVI-style: 4/2-bit K and V plus a 16-bit scale and zero per group
  droidspeak  16-bit K/V for most layers; the attention input of the recomputed layers
  reuse       per layer a rank-r_K code for K and a rank-r_V code for V, 16 bit
  scd         reuse codes on reuse layers, a rank-r_H code of the attention input on
              patch layers (aligner + the consumer's own k/v projections); a run ships one
              code of the residual and the consumer computes the run's layers (their prefill)
  scd-int8    scd with int8 codes (a 16-bit scale per code channel)
Tokens shipped are T-1: the decode side runs the last prompt token as its first step.
"""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.planner.shapes import ModelShape

# the methods method_cost models: the consumer's own prefill ("oracle") and config/methods.py's
# transfer methods but identity (a test codec); spelled out, so a method added to the vocabulary
# gets its cost model here before `scd-serve plan` offers it
METHODS = ("oracle", "raw", "quant4", "quant2", "droidspeak", "reuse", "scd", "scd-int8")
HALF = 2  # bytes per 16-bit element


@dataclass(frozen=True)
class RankPlan:
    """Rank ratios (rank / width) applied to a real shape; from a codebook or the defaults."""

    k_ratio: float = 0.5  # mean r_K / kv_width over reuse layers
    v_ratio: float = 0.7  # mean r_V / kv_width
    patch_fraction: float = 6 / 32  # share of layers that are patch layers
    h_ratio: float = 0.72  # r_H / hidden_size on patch layers
    reuse_k_ratio: float | None = None  # ranks of the reuse-only plan; None = same as scd's
    reuse_v_ratio: float | None = None
    aligner_width_ratio: float = 0.25  # hidden width of the aligner's MLP branch / hidden_size
    run_fraction: float = 0.0  # share of layers the consumer runs itself (a run: codec/plan.py)
    run_ratio: float = 1.0  # rank of the run's residual code / hidden_size
    droidspeak_fraction: float = 4 / 32  # share of layers DroidSpeak recomputes (first eighth)
    quant_group: int = 32  # elements per fp16 scale/min pair in quant4/quant2 (as scd_serve.codec.quant)
    source: str = "defaults (payload ratios of the SCD paper: reuse 0.60x raw, scd 0.76x raw)"
    caveat: str = ""  # why these ratios may not carry to another shape (printed with them)

    def num_patch(self, num_layers: int) -> int:
        return int(round(self.patch_fraction * num_layers))


@dataclass(frozen=True)
class MethodCost:
    method: str
    payload_bytes: float  # on the wire, per request
    encode_flops: float  # producer side, after its prefill
    encode_bytes: float
    rebuild_flops: float  # consumer side, codes -> KV cache
    rebuild_bytes: float  # consumer memory traffic while rebuilding


def method_cost(method: str, shape: ModelShape, prompt_tokens: int, plan: RankPlan) -> MethodCost:
    t = max(1, prompt_tokens - 1)
    L, d, h = shape.num_layers, shape.kv_width, shape.hidden_size
    kv_layer = t * 2 * d * HALF  # one layer's K+V in 16 bit
    kv_all = L * kv_layer
    rk, rv, rh = plan.k_ratio * d, plan.v_ratio * d, plan.h_ratio * h
    if method == "reuse" and plan.reuse_k_ratio is not None:
        rk, rv = plan.reuse_k_ratio * d, (plan.reuse_v_ratio or plan.v_ratio) * d
    if method == "oracle":
        return MethodCost(method, 0.0, 0.0, 0.0, 0.0, 0.0)
    if method == "raw":
        return MethodCost(method, kv_all, 0.0, 0.0, 0.0, 2 * kv_all)
    if method in ("quant4", "quant2"):
        bits = 4 if method == "quant4" else 2
        per_elem = bits / 8 + 2 * HALF / plan.quant_group
        payload = L * t * 2 * d * per_elem
        return MethodCost(method, payload, 0.0, kv_all + payload, 0.0, payload + kv_all)
    if method == "droidspeak":
        n = max(1, int(round(plan.droidspeak_fraction * L)))
        payload = (L - n) * kv_layer + n * t * h * HALF
        flops = n * 2.0 * t * h * 2 * d  # consumer's own k_proj and v_proj
        weights = n * h * 2 * d * HALF
        return MethodCost(method, payload, 0.0, 0.0, flops, payload + kv_all + weights)
    n_patch = plan.num_patch(L) if method in ("scd", "scd-int8") else 0
    n_run = int(round(plan.run_fraction * L)) if method in ("scd", "scd-int8") else 0
    r_run = plan.run_ratio * h if n_run else 0.0
    n_reuse = L - n_patch - n_run
    code_bytes = 1 if method == "scd-int8" else HALF
    payload = (n_reuse * t * (rk + rv) + n_patch * t * rh + t * r_run) * code_bytes
    if method == "scd-int8":
        payload += (n_reuse * (rk + rv) + n_patch * rh + r_run) * HALF  # fp16 scale per code channel
    enc = n_reuse * 2.0 * t * d * (rk + rv) + n_patch * 2.0 * t * h * rh + 2.0 * t * h * r_run
    reuse_flops = n_reuse * 2.0 * t * d * (rk + rv)
    # aligner: linear r_H -> hidden plus an MLP r_H -> w -> hidden; then the k/v projections
    w = plan.aligner_width_ratio * h
    aligner = rh * h + rh * w + w * h
    patch_flops = n_patch * (2.0 * t * aligner + 2.0 * t * h * 2 * d)
    run_flops = (2.0 * t * r_run * h + n_run * shape.layer_flops(t)) if n_run else 0.0  # map, then the layers
    weights = (n_reuse * (rk + rv) * d + n_patch * (aligner + 2 * h * d) + r_run * h
               + n_run * shape.layer_params) * HALF
    return MethodCost(method, payload, enc, weights, reuse_flops + patch_flops + run_flops,
                      payload + kv_all + weights)
