"""A long prompt's layer output (projection, MLP) is finished in blocks of MLP_ROWS rows outside
autograd (model/layers.finish_layer): the same result as one pass over every row."""

import torch

from scd_serve.model.layers import MLP_ROWS, _finish_rows, finish_layer
from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


def test_row_blocks_give_the_one_pass_result(tmp_path):
    rt = ModelRuntime.load(save_tiny_model(tmp_path, "llama", seed=3, tokenizer=False), dtype="float32")
    lw, spec = rt.weights.layers[0], rt.spec
    gen = torch.Generator().manual_seed(0)
    rows = 2 * MLP_ROWS + 37  # two whole blocks and a part
    h = torch.randn(1, rows, spec.hidden_size, generator=gen)  # h: [B, T, hidden]
    attn = torch.randn(1, rows, spec.num_heads * spec.head_dim, generator=gen)
    with torch.inference_mode():
        blocked = finish_layer(lw, spec, h, attn)
        whole = _finish_rows(lw, spec, h, attn)
    assert blocked.shape == h.shape
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
    with torch.enable_grad():  # autograd (calibration) keeps one pass
        assert torch.equal(finish_layer(lw, spec, h, attn), _finish_rows(lw, spec, h, attn))
