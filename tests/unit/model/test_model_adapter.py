"""A PEFT LoRA adapter directory loads as a model: its base with the adapter merged in, the
logits peft's own merge gives (peft makes the adapter here; serving reads it without peft)."""

import json

import pytest
import torch

from scd_serve.errors import ModelLoadError
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_CACHE_DIR", str(tmp_path / "cache"))


def make_adapter(tmp_path, base, rslora=False):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=rslora,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    out = tmp_path / "adapter"
    peft_model.save_pretrained(str(out))
    merged = tmp_path / "peft-merged"
    peft_model.merge_and_unload().save_pretrained(str(merged))
    for f in base.iterdir():  # the tokenizer, as the base has it
        if f.name.startswith("tokenizer"):
            (merged / f.name).write_bytes(f.read_bytes())
    return out, merged


@pytest.mark.parametrize("rslora", [False, True])
def test_an_adapter_directory_is_served_as_its_base_with_the_adapter_merged(tmp_path, rslora):
    base = save_tiny_model(tmp_path / "base", "llama", seed=3)
    adapter, peft_merged = make_adapter(tmp_path, base, rslora)
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(0))
    ours, theirs = ModelRuntime.load(adapter), ModelRuntime.load(peft_merged)
    torch.testing.assert_close(ours.prefill(ids, capture=False).logits, theirs.prefill(ids, capture=False).logits,
                               atol=1e-4, rtol=1e-4)
    plain = ModelRuntime.load(base).prefill(ids, capture=False).logits
    assert (plain - ours.prefill(ids, capture=False).logits).abs().max() > 1e-3  # the adapter changed something
    assert ours.fingerprint != ModelRuntime.load(base).fingerprint  # another consumer model
    assert ModelRuntime.load(adapter).fingerprint == ours.fingerprint  # read back from the cache


def test_an_adapter_whose_base_is_not_here_says_what_to_set(tmp_path):
    base = save_tiny_model(tmp_path / "base", "llama", seed=3)
    adapter, _ = make_adapter(tmp_path, base)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": "org/some-hub-model"}))
    with pytest.raises(ModelLoadError, match="set base_model_name_or_path"):
        ModelRuntime.load(adapter)
