"""The error table and the CLI's handling of expected failures."""

import types

import pytest

from scd_serve import cli, errors


def error_table() -> list[tuple[str, int, str]]:
    """(kind, http status, grpc code) of every error class."""
    rows, stack = [], [errors.ScdError]
    while stack:
        cls = stack.pop()
        rows.append((cls.kind, cls.http_status, cls.grpc_code))
        stack.extend(cls.__subclasses__())
    return sorted(set(rows))


def test_every_error_type_has_a_client_or_server_status_and_a_grpc_code():
    import grpc

    rows = error_table()
    assert len(rows) >= 10
    for type_name, http_status, grpc_code in rows:
        assert 400 <= http_status < 600, type_name
        assert hasattr(grpc.StatusCode, grpc_code), (type_name, grpc_code)


def test_body_shape_is_the_same_for_every_error():
    body = errors.PromptTooLong("prompt has 10 tokens", field="prompt").to_body("req-1")
    assert body == {"error": {"type": "invalid_request_error", "message": "prompt has 10 tokens",
                              "request_id": "req-1", "param": "prompt", "code": "context_length_exceeded"}}
    # OpenAI's shape: param and code are always there, null when there is none
    assert errors.ScdError("boom").to_body() == {"error": {"message": "boom", "type": "server_error",
                                                           "param": None, "code": "internal_error",
                                                           "request_id": None}}
    # OpenAI's type strings, which clients branch on; the finer name in code
    assert [(e.type, e.body_code) for e in (errors.InvalidRequest("x"), errors.Unauthorized("x"),
                                            errors.NotFound("x"), errors.Overloaded(), errors.TransferFailed("x"))] == [
        ("invalid_request_error", None), ("authentication_error", "invalid_api_key"), ("not_found_error", "not_found"),
        ("rate_limit_error", "rate_limit_exceeded"), ("server_error", "transfer_failed")]
    assert errors.ValidationFailed("x").http_status == 400
    assert errors.Overloaded().headers["Retry-After"] == "1"
    assert errors.Overloaded().http_status == 429


def test_cli_turns_an_expected_error_into_one_line_and_exit_2(monkeypatch, capsys):
    def failing_run(args):
        raise errors.ModelLoadError("no config.json in /nowhere")

    fake = types.SimpleNamespace(add_arguments=lambda p: None, run=failing_run)
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: fake)
    assert cli.main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "no config.json in /nowhere" in err and "Traceback" not in err


def test_cli_lists_every_command_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_prefill_engine_flags_fail_with_a_line_that_says_what_to_do(monkeypatch, capsys):
    """--engine vllm where vLLM is not installed (this suite's venv), and --vllm-args without it:
    exit 2 before anything loads, the message naming what to install or which flag to add."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert cli.main(["prefill", "--engine", "vllm", "--port", "0"]) == 2
    assert "--engine vllm needs vLLM in this Python" in capsys.readouterr().err
    assert cli.main(["prefill", "--vllm-args", "{}", "--port", "0"]) == 2
    assert "--vllm-args is for --engine vllm" in capsys.readouterr().err
    # with vLLM there (as found), bad engine arguments are refused before it is imported
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    for bad, said in (("[1]", "must be a JSON object"), ("{nope", "is not JSON")):
        assert cli.main(["prefill", "--engine", "vllm", "--vllm-args", bad, "--port", "0"]) == 2
        assert said in capsys.readouterr().err
