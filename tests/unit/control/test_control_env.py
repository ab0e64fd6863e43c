"""SCD_<OPTION> environment defaults of the serving roles (scd_serve/config/env.py)."""

from __future__ import annotations

import pytest

from scd_serve.cli import ENV_CONFIGURED, build_parser, main
from scd_serve.config.env import apply_env_defaults
from scd_serve.errors import ConfigError


def parse(role: str, argv: list[str], monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser(role).parse_args([role, *argv])


def test_every_option_of_every_role_has_its_variable(monkeypatch):
    args = parse("decode", [], monkeypatch, SCD_MAX_MODEL_LEN="4096", SCD_DTYPE="bfloat16",
                 SCD_SERVED_MODEL_NAME="a, b", SCD_ALLOW_INCOMPATIBLE="yes", SCD_BREAKER_COOLDOWN_S="0.5")
    assert (args.max_model_len, args.dtype, args.served_model_name) == (4096, "bfloat16", ["a", "b"])
    assert args.allow_incompatible is True and args.breaker_cooldown_s == 0.5
    assert parse("prefill", [], monkeypatch, SCD_MAX_CONCURRENT="9").max_concurrent == 9
    assert parse("gateway", [], monkeypatch, SCD_PORT="9100").port == 9100
    up = parse("up", [], monkeypatch, SCD_DECODE_WORKERS="3")
    assert up.decode_workers == 3 and up.max_model_len == 4096 and up.dtype == "bfloat16"


def test_a_flag_wins_over_the_variable(monkeypatch):
    args = parse("decode", ["--max-model-len", "512"], monkeypatch, SCD_MAX_MODEL_LEN="4096")
    assert args.max_model_len == 512


@pytest.mark.parametrize("name, value, says", [
    ("SCD_MAX_MODEL_LEN", "big", "--max-model-len expects int"),
    ("SCD_DTYPE", "fp8", "--dtype must be one of auto, float32, bfloat16, float16"),
    ("SCD_ALLOW_INCOMPATIBLE", "maybe", "--allow-incompatible is a switch"),
    ("SCD_SERVED_MODEL_NAME", " , ", "needs at least one value"),
])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, capsys, name, value, says):
    monkeypatch.setenv(name, value)
    assert main(["decode"]) == 2
    err = capsys.readouterr().err
    assert name in err and says in err


def test_only_serving_roles_read_the_environment(monkeypatch):
    monkeypatch.setenv("SCD_SEED", "7")
    assert build_parser("make-demo-pair").parse_args(["make-demo-pair"]).seed != 7
    assert set(ENV_CONFIGURED) == {"prefill", "decode", "gateway", "up"}


def test_the_environment_is_explicit_when_given():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--num-blocks", type=int, default=0)
    assert apply_env_defaults(p, {"SCD_NUM_BLOCKS": "12"}) == {"num_blocks": 12}
    assert p.parse_args([]).num_blocks == 12
    with pytest.raises(ConfigError, match="SCD_NUM_BLOCKS"):
        apply_env_defaults(p, {"SCD_NUM_BLOCKS": "1.5"})
