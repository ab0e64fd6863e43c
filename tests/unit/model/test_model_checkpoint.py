"""Which safetensors files a directory's checkpoint is, memory-mapped tensors, and the
fingerprint: sharding-independent, unchanged by the new reader, cached across starts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from scd_serve.errors import ModelLoadError
from scd_serve.model import ModelRuntime
from scd_serve.model.checkpoint import Checkpoint
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def single(tmp_path):
    return save_tiny_model(tmp_path / "single", "qwen2", tokenizer=False)


def shard(single, out):
    """The same tensors in two files with an index, plus a Mistral-style consolidated file of other names."""
    shutil.copytree(single, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(single / "model.safetensors")
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in half.items():
        save_file({n: tensors[n] for n in part}, str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in half.items() for n in part}}))
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(out / "consolidated.safetensors"))
    return out


def test_index_is_followed_and_the_fingerprint_does_not_depend_on_sharding(single, tmp_path):
    one = ModelRuntime.load(single)
    two = ModelRuntime.load(shard(single, tmp_path / "sharded"))
    assert two.fingerprint == one.fingerprint
    ids = torch.arange(10)
    assert torch.equal(two.prefill(ids, capture=False).logits, one.prefill(ids, capture=False).logits)


def test_model_safetensors_wins_over_other_files_without_an_index(single):
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(single / "consolidated.safetensors"))
    ModelRuntime.load(single)  # consolidated.safetensors is not read


def test_a_bad_index_is_a_clear_error(single, tmp_path):
    out = shard(single, tmp_path / "sharded")
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors, not in"):
        ModelRuntime.load(out)
    (out / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable index"):
        ModelRuntime.load(out)


def test_the_fingerprint_is_cached_and_a_changed_file_is_hashed_again(single, cache_dir, monkeypatch):
    first = ModelRuntime.load(single).fingerprint
    assert (cache_dir / "fingerprints.json").exists()
    monkeypatch.setattr(Checkpoint, "raw", lambda self, name: (_ for _ in ()).throw(AssertionError("rehashed")))
    assert ModelRuntime.load(single).fingerprint == first  # from the cache: no tensor bytes read
    monkeypatch.undo()
    monkeypatch.setenv("SCD_CACHE_DIR", str(cache_dir))
    tensors = load_file(single / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(single / "model.safetensors"), metadata={"format": "pt"})
    assert ModelRuntime.load(single).fingerprint != first


def test_tensors_used_as_stored_are_views_of_the_file_map(single):
    ckpt = Checkpoint([single / "model.safetensors"])
    t = ckpt.tensor("model.norm.weight")
    assert torch.equal(t, load_file(single / "model.safetensors")["model.norm.weight"])
    t += 1  # a private map: the file is untouched
    assert torch.equal(Checkpoint([single / "model.safetensors"]).tensor("model.norm.weight"), t - 1)


def test_a_truncated_file_is_refused_with_the_tensor_named(single):
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(ModelLoadError, match="lies outside the file"):
        ModelRuntime.load(single)
