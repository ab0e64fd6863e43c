"""Weights of one model: read from its safetensors (checkpoint.py), checked against the spec,
regrouped per layer: k_proj and v_proj fused into one [2*kv_width, hidden] matrix (one GEMM;
recompute_kv uses the same op, so it reproduces prefill's K/V bit for bit), gate and up too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from scd_serve.errors import ModelLoadError
from scd_serve.model.checkpoint import Checkpoint, weight_files
from scd_serve.model.spec import ModelSpec

Tensor = torch.Tensor


@dataclass
class LayerWeights:
    ln1: Tensor  # [hidden] input_layernorm
    wq: Tensor  # [q_width, hidden]
    bq: Tensor | None
    wkv: Tensor  # [2*kv_width, hidden]: k rows then v rows
    bkv: Tensor | None
    q_norm: Tensor | None  # [head_dim] (Qwen3)
    k_norm: Tensor | None
    wo: Tensor  # [hidden, q_width]
    bo: Tensor | None
    ln2: Tensor  # [hidden] post_attention_layernorm
    w_gate_up: Tensor  # [2*intermediate, hidden]: gate rows then up rows
    b_gate_up: Tensor | None
    w_down: Tensor  # [hidden, intermediate]
    b_down: Tensor | None


@dataclass
class ModelWeights:
    embed: Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: Tensor  # [hidden]
    lm_head: Tensor  # [vocab, hidden] (the embedding itself when tied; a layers.PackedWeight once packed for serving)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for exactly the tensors this spec needs."""
    h, q, kv, inter = spec.hidden_size, spec.q_width, spec.kv_width, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if spec.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (spec.head_dim,), p + "self_attn.k_norm.weight": (spec.head_dim,)}
        if spec.mlp_bias:
            shapes |= {p + f"mlp.{n}_proj.bias": ((inter,) if n != "down" else (h,)) for n in ("gate", "up", "down")}
    return shapes


def read_tensors(path: Path, spec: ModelSpec) -> tuple[dict[str, Tensor], str]:
    """All expected tensors (as stored, memory-mapped) and the hex sha256 over config essentials
    + weights (model/checkpoint.py)."""
    ckpt = Checkpoint(weight_files(path))
    expected = expected_shapes(spec)
    for name, (i, *_) in ckpt.entries.items():
        skipped = (spec.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")
        if name not in expected and not skipped:  # a tied lm_head copy is ignored, as HF does
            raise ModelLoadError(f"{ckpt.files[i].name}: unexpected tensor {name!r} for a {spec.family} model")
    if missing := [n for n in expected if n not in ckpt.entries]:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: weights missing {', '.join(missing[:3])}{more}")
    for name, shape in expected.items():
        if tuple(ckpt.entries[name][2]) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(ckpt.entries[name][2])}, config says {shape}")
    found = {name: ckpt.tensor(name) for name in expected}
    return found, ckpt.fingerprint(json.dumps(asdict(spec), sort_keys=True), list(expected))


def group(found: dict[str, Tensor], spec: ModelSpec, device, dtype) -> ModelWeights:
    def get(name: str) -> Tensor:
        return found[name].to(device=device, dtype=dtype)

    def opt(name: str) -> Tensor | None:
        return get(name) if name in found else None

    def cat(*names: str) -> Tensor | None:
        if names[0] not in found:
            return None
        return torch.cat([found[n] for n in names], dim=0).to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            ln1=get(p + "input_layernorm.weight"), wq=get(a + "q_proj.weight"), bq=opt(a + "q_proj.bias"),
            wkv=cat(a + "k_proj.weight", a + "v_proj.weight"), bkv=cat(a + "k_proj.bias", a + "v_proj.bias"),
            q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
            wo=get(a + "o_proj.weight"), bo=opt(a + "o_proj.bias"), ln2=get(p + "post_attention_layernorm.weight"),
            w_gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
            b_gate_up=cat(m + "gate_proj.bias", m + "up_proj.bias"),
            w_down=get(m + "down_proj.weight"), b_down=opt(m + "down_proj.bias")))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)
