"""ModelSpec: the architecture facts of one HF decoder-only model, parsed from config.json
as a plain dict (no transformers import), so a bad directory fails fast, named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scd_serve.errors import ModelLoadError

# model_type -> the HF architecture class name it ships with
SUPPORTED: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# rope types whose inv_freq does not depend on the sequence length (dynamic ones do)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 always)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    tie_word_embeddings: bool
    o_bias: bool = False  # o_proj bias (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama mlp_bias)
    rope_type: str = "default"
    sliding_window: int | None = None  # keys older than this many positions are masked
    sliding_layers: tuple[int, ...] = ()  # layers that use sliding_window
    hidden_act: str = "silu"

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rotary parameters from either layout: transformers 5.x `rope_parameters`, or the
    older top-level `rope_theta` plus optional `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def spec_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelSpec:
    family = cfg.get("model_type")
    supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED.items())
    if family not in SUPPORTED:
        raise ModelLoadError(f"{where}: unsupported model_type {family!r}; supported: {supported}")
    archs = cfg.get("architectures") or [SUPPORTED[family]]
    if SUPPORTED[family] not in archs:
        raise ModelLoadError(f"{where}: unsupported architecture {archs}; supported: {supported}")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads, layers = int(cfg.get("num_key_value_heads") or heads), int(cfg["num_hidden_layers"])
        sizes = dict(intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                     max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                     rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: missing or invalid field {exc}") from None
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    rope = rope_params(cfg)
    if rope["rope_type"] not in STATIC_ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {rope['rope_type']!r} is not supported; supported: "
                             f"{', '.join(STATIC_ROPE_TYPES)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor != 1 is not supported")
    bias = bool(cfg.get("attention_bias") or False)
    window, sliding = _sliding(cfg, family, layers)
    return ModelSpec(family=family, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, rope_theta=float(rope["rope_theta"]),
                     attention_bias=True if family == "qwen2" else bias, qk_norm=family == "qwen3",
                     tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     o_bias=bias and family in ("llama", "qwen3"),
                     mlp_bias=bool(cfg.get("mlp_bias") or False) and family == "llama",
                     rope_type=rope["rope_type"], sliding_window=window, sliding_layers=sliding, hidden_act=act,
                     **sizes)


def _sliding(cfg: dict[str, Any], family: str, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Which layers use a sliding window, following each family's HF rules."""
    window = cfg.get("sliding_window")
    if family == "llama" or not window:
        return None, ()
    if family == "mistral":
        return int(window), tuple(range(layers))
    types = cfg.get("layer_types")
    if types is None:
        if not cfg.get("use_sliding_window", False):
            return None, ()
        first = int(cfg.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window) if sliding else None), sliding
