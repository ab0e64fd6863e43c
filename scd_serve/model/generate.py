"""`scd-serve generate`: greedy completion of one prompt with one local model."""

from __future__ import annotations

import argparse

import torch

from scd_serve.config.model import DTYPE_NAMES, ModelConfig
from scd_serve.errors import InvalidRequest, ModelLoadError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local HF model directory (config.json + *.safetensors + tokenizer)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)


def run(args: argparse.Namespace) -> int:
    from scd_serve.model.runtime import ModelRuntime

    config = ModelConfig(path=args.model, device=args.device, dtype=args.dtype)
    if args.max_tokens < 1:
        raise InvalidRequest(f"--max-tokens must be >= 1, got {args.max_tokens}", field="max_tokens")
    rt = ModelRuntime.load(config.path, config.device, config.torch_dtype)
    tok = rt.tokenizer
    if tok is None:
        raise ModelLoadError(f"{config.path}: no tokenizer files (tokenizer.json / tokenizer_config.json); generate needs one")
    ids = tok(args.prompt)["input_ids"]
    if not ids:
        raise InvalidRequest("the prompt is empty after tokenization", field="prompt")
    out = rt.generate_greedy(torch.tensor(ids), args.max_tokens, eos_token_id=tok.eos_token_id)
    print(tok.decode(out, skip_special_tokens=True))
    return 0
