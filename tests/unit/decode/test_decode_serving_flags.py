"""vLLM's serving flags: --max-num-seqs, --chat-template, --seed (decode, and up passing them on),
and up's --api-key."""

import pytest

from scd_serve import cli
from scd_serve.cluster.up import cluster_env, decode_flags
from scd_serve.config.engine import EngineConfig
from scd_serve.decode.main import chat_template, config_from_args
from scd_serve.errors import ConfigError
from scd_serve.testing.fake_runtime import byte_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[a]{% endif %}"


def test_decode_takes_the_flags_into_its_config():
    args = cli.build_parser(only="decode").parse_args(["decode", "--max-num-seqs", "7", "--seed", "11",
                                                       "--chat-template", TEMPLATE])
    config = config_from_args(args)
    assert (config.max_num_seqs, config.seed, config.chat_template) == (7, 11, TEMPLATE)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        config_from_args(cli.build_parser(only="decode").parse_args(["decode", "--max-num-seqs", "0"]))
    chunk = ["decode", "--max-num-batched-tokens"]
    assert config_from_args(cli.build_parser(only="decode").parse_args([*chunk, "2048"])).max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        config_from_args(cli.build_parser(only="decode").parse_args([*chunk, "0"]))
    assert not config_from_args(cli.build_parser(only="decode").parse_args(["decode", "--no-enable-prefix-caching"])) \
        .enable_prefix_caching


def test_a_chat_template_comes_from_a_file_or_inline_and_a_broken_one_stops_the_start(tmp_path):
    tok = byte_tokenizer()
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template(str(path), tok) == TEMPLATE == chat_template(TEMPLATE, tok)
    assert chat_template("", tok) == ""
    with pytest.raises(ConfigError, match="no such file"):
        chat_template(str(tmp_path / "missing.jinja"), tok)
    with pytest.raises(ConfigError, match="does not render"):
        chat_template("{% for m in messages %}{{ m.role ", tok)


def test_up_passes_the_decode_flags_on_and_the_api_key_by_environment():
    args = cli.build_parser(only="up").parse_args(["up", "--api-key", "sk-up-key-123", "--max-num-seqs", "4",
                                                   "--seed", "3", "--chat-template", "t.jinja"])
    flags = decode_flags(args, [])
    assert flags == ["--max-num-seqs", "4", "--chat-template", "t.jinja", "--seed", "3"]
    assert "sk-up-key-123" not in flags and cluster_env({}, args.api_key)["SCD_API_KEY"] == "sk-up-key-123"
    assert decode_flags(cli.build_parser(only="up").parse_args(["up"]), []) == []
    assert decode_flags(args, ["coder"])[:2] == ["--served-model-name", "coder"]  # an expert's workers


def test_up_checks_each_expert_it_is_given(tmp_path):
    from scd_serve.config.expert import parse_experts

    (tmp_path / "coder").mkdir()
    (tmp_path / "coder" / "adapter_config.json").write_text("{}")
    got = parse_experts([f"coder={tmp_path / 'coder'}"], {"consumer"})
    assert got == [("coder", str(tmp_path / "coder"), "")]
    for spec, why in ((f"{tmp_path / 'coder'}", "NAME=DIR"), (f"consumer={tmp_path / 'coder'}", "served already"),
                      (f"x={tmp_path / 'nothing'}", "neither a model"), (f"y={tmp_path / 'coder'}:{tmp_path}", "codebook")):
        with pytest.raises(ConfigError, match=why):
            parse_experts([spec], {"consumer"})


def test_the_seed_is_checked():
    with pytest.raises(ConfigError, match="seed"):
        EngineConfig(seed=-1)
