"""Bad input: each a ModelLoadError / PromptTooLong / InvalidRequest naming the problem,
and `scd-serve generate` prints one line, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from scd_serve import cli
from scd_serve.config.model import ModelConfig
from scd_serve.errors import ConfigError, InvalidRequest, ModelLoadError, PromptTooLong
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=64)


@pytest.fixture(scope="module")
def rt(model_dir):
    return ModelRuntime.load(model_dir)


def copy_with_config(model_dir, tmp_path, **changes):
    dst = tmp_path / "m"
    shutil.copytree(model_dir, dst)
    cfg = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        ModelRuntime.load(path)
    return info.value.message


def test_missing_directory(tmp_path):
    assert "no such model directory" in load_error(tmp_path / "absent")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "no config.json" in load_error(tmp_path)


def test_a_file_is_not_a_model_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "expected a model directory" in load_error(tmp_path / "f")


def test_broken_config_json(model_dir, tmp_path):
    dst = copy_with_config(model_dir, tmp_path)
    (dst / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(dst)


def test_unsupported_model_type_is_named_with_supported_list(model_dir, tmp_path):
    msg = load_error(copy_with_config(model_dir, tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    assert "'gpt2'" in msg and "llama" in msg and "qwen3" in msg and "mistral" in msg and "qwen2" in msg


def test_unsupported_architecture(model_dir, tmp_path):
    msg = load_error(copy_with_config(model_dir, tmp_path, architectures=["LlamaForSequenceClassification"]))
    assert "LlamaForSequenceClassification" in msg and "LlamaForCausalLM" in msg


def test_missing_config_field(model_dir, tmp_path):
    dst = copy_with_config(model_dir, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["hidden_size"]
    (dst / "config.json").write_text(json.dumps(cfg))
    assert "hidden_size" in load_error(dst)


def test_no_weights(model_dir, tmp_path):
    dst = copy_with_config(model_dir, tmp_path)
    (dst / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(dst)


def test_weights_do_not_match_config(model_dir, tmp_path):
    msg = load_error(copy_with_config(model_dir, tmp_path, intermediate_size=96))
    assert "mlp" in msg and "shape" in msg
    msg = load_error(copy_with_config(model_dir, tmp_path / "b", num_hidden_layers=3))
    assert "missing" in msg and "model.layers.2." in msg


def test_truncated_weights(model_dir, tmp_path):
    dst = copy_with_config(model_dir, tmp_path)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in load_error(dst)


def test_dynamic_rope_is_refused(model_dir, tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert "'dynamic'" in load_error(copy_with_config(model_dir, tmp_path, rope_parameters=rope))


def test_old_style_rope_theta_is_read(model_dir, tmp_path):
    dst = copy_with_config(model_dir, tmp_path, rope_parameters=None, rope_theta=12345.0)
    assert ModelRuntime.load(dst).spec.rope_theta == 12345.0


def test_cuda_requested_without_cuda(model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        ModelRuntime.load(model_dir, device="cuda")


def test_tokenizer_optional(model_dir, tmp_path, rt):
    dst = copy_with_config(model_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).unlink()
    assert ModelRuntime.load(dst).tokenizer is None and rt.tokenizer is not None


def test_prompt_too_long_names_both_numbers(rt):
    with pytest.raises(PromptTooLong) as info:
        rt.generate_greedy(torch.zeros(60, dtype=torch.long), 10)
    assert "60" in info.value.message and "64" in info.value.message
    with pytest.raises(PromptTooLong, match="64"):
        rt.prefill(torch.zeros(65, dtype=torch.long))


def test_bad_ids_and_pool_use(rt):
    with pytest.raises(InvalidRequest, match="0..255"):
        rt.prefill(torch.tensor([1, 256]))
    with pytest.raises(InvalidRequest, match="1-D"):
        rt.prefill(torch.zeros(2, 3, dtype=torch.long))
    pool = rt.new_kv_pool(2, 4)
    with pytest.raises(InvalidRequest, match="do not fit"):
        rt.extend(pool, [([0], 0, torch.arange(5))])
    with pytest.raises(InvalidRequest, match="block ids"):
        rt.decode_step(pool, [([5, 0], 1, 3)])
    with pytest.raises(InvalidRequest, match="layer 7"):
        rt.recompute_kv(7, torch.zeros(1, 64))
    with pytest.raises(InvalidRequest, match=r"attn_input must be \[T, 64\]"):
        rt.recompute_kv(0, torch.zeros(3, 32))
    with pytest.raises(InvalidRequest, match=r"k_pre must be \[T, 2, 16\]"):
        rt.write_kv(pool, [0, 1], 0, torch.zeros(3, 32), torch.zeros(3, 32))
    with pytest.raises(InvalidRequest, match="shape of k_pre"):
        rt.write_kv(pool, [0, 1], 0, torch.zeros(3, 2, 16), torch.zeros(4, 2, 16))


def test_model_config_validation():
    assert ModelConfig("x", "cuda:1", "bfloat16").torch_dtype == torch.bfloat16
    for bad in (dict(device="tpu"), dict(dtype="int8"), dict(path="")):
        with pytest.raises(ConfigError):
            ModelConfig(**({"path": "x"} | bad))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_generate_prints_greedy_completion(model_dir, rt, capsys):
    rc, out, err = run_cli(capsys, "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "6")
    tok = rt.tokenizer
    expected = rt.generate_greedy(torch.tensor(tok("hello")["input_ids"]), 6)
    assert rc == 0 and out == tok.decode(expected) + "\n"


@pytest.mark.parametrize("case", ["missing", "not-a-model", "too-long", "no-tokenizer"])
def test_cli_generate_errors_are_one_line(case, model_dir, tmp_path, capsys):
    args = {"missing": [str(tmp_path / "nope")], "not-a-model": [str(tmp_path)]}.get(case, [str(model_dir)])
    tokens = "100" if case == "too-long" else "4"
    if case == "no-tokenizer":
        dst = copy_with_config(model_dir, tmp_path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (dst / name).unlink()
        args = [str(dst)]
    rc, out, err = run_cli(capsys, "--model", *args, "--prompt", "hi", "--max-tokens", tokens)
    want = {"missing": "no such model directory", "not-a-model": "no config.json",
            "too-long": "context of 64", "no-tokenizer": "no tokenizer"}[case]
    assert rc == 2 and out == "" and want in err
    assert "Traceback" not in err and err.count("\n") == 1
