"""Progressive stacking: grow a trained shallow Llama (or Qwen2) into a deeper one that computes the same function.

A 2-layer model finds the induction circuit (the in-context lookup) in a few hundred
cheap steps; an 8-layer one from scratch takes far longer on two cores. Each layer of
the shallow model becomes a group of consecutive layers: the first is the original, the
others are copies whose output projections (o_proj, down_proj) start at zero, so the
residual stream and the logits are unchanged at the moment of growing. Training then
continues on all layers, and the copies move away from their source.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from scd_serve.errors import ConfigError


def grow(small: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    have = small.config.num_hidden_layers
    if num_layers % have:
        raise ConfigError(f"cannot grow {have} layers to {num_layers}: not a multiple")
    factor = num_layers // have
    cfg = copy.deepcopy(small.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * num_layers
    big = type(small)(cfg)  # LlamaForCausalLM, Qwen2ForCausalLM: same layer layout
    src = small.state_dict()
    dst = {}
    for name, tensor in big.state_dict().items():
        if ".layers." not in name:
            dst[name] = src[name].clone()
            continue
        prefix, rest = name.split(".layers.")
        index, tail = rest.split(".", 1)
        source_layer, copy_no = divmod(int(index), factor)
        value = src[f"{prefix}.layers.{source_layer}.{tail}"].clone()
        if copy_no and tail in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            value = torch.zeros_like(value)  # the copy adds nothing until training moves it
        dst[name] = value
    big.load_state_dict(dst)
    return big
