"""`scd-serve` entry point.

Each subcommand's module exposes `add_arguments(parser)` and `run(args) -> int`, imported
lazily so `--help` starts fast and one broken area does not take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from scd_serve.config.env import apply_env_defaults
from scd_serve.control.allocator import reexec_with_allocator
from scd_serve.errors import ScdError

COMMANDS: dict[str, tuple[str, str]] = {  # name -> (module, one-line help)
    "generate": ("scd_serve.model.generate", "greedy completion from one local model"),
    "make-demo-pair": ("scd_serve.pair.make_pair", "train the embedded producer/consumer pair"),
    "make-pair-zoo": ("scd_serve.pair.zoo_recipe", "train a zoo of base/fine-tune pairs on real text (hours)"),
    "eval": ("scd_serve.quality.harness", "quality of a transfer method against the oracle"),
    "calibrate": ("scd_serve.quality.calibrate", "fit an SCD codebook for a producer/consumer pair"),
    "measure": ("scd_serve.quality.measure", "a codebook's quality figures on held-out texts (--write: into its manifest)"),
    "prefill": ("scd_serve.prefill.main", "run a prefill worker (producer model)"),
    "decode": ("scd_serve.decode.main", "run a decode worker (consumer model + HTTP API)"),
    "gateway": ("scd_serve.gateway.main", "run the HTTP gateway in front of decode workers"),
    "up": ("scd_serve.cluster.up", "start a local prefill + decode + gateway cluster"),
    "demo": ("scd_serve.bench.demo", "what SCD buys: the context pair over a shaped link, every method side by side"),
    "bench": ("scd_serve.bench.main", "benchmarks: ttft over a shaped link, serving load"),
    "plan": ("scd_serve.planner.project", "project payload and TTFT for real model shapes"),
    "make-shaped-pair": ("scd_serve.bench.shaped_pair", "random-weight pair with a real model's shape (cost only)"),
    "build-kernels": ("scd_serve.model.cpu_kernel", "build the CPU's C++ decode attention here (workers build it at first start)"),
}
# --engine NAME: the command served by another engine's module (imported only when chosen)
ENGINES = {"vllm": "scd_serve.vllm.producer"}
# the serving roles: each option also from SCD_<OPTION> (scd_serve/config/env.py)
ENV_CONFIGURED = ("prefill", "decode", "gateway", "up")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scd-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:  # only the chosen command's module is imported
            importlib.import_module(module_name).add_arguments(sp)
            if name in ENV_CONFIGURED:
                apply_env_defaults(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    from_command_line, argv = argv is None, sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    try:
        if from_command_line and "-h" not in argv and "--help" not in argv:
            reexec_with_allocator(chosen or "", argv)  # before anything starts a thread
        args = build_parser(chosen).parse_args(argv)
    except ScdError as exc:  # a bad SCD_* variable
        print(f"scd-serve {chosen}: error: {exc.message}", file=sys.stderr)
        return 2
    module = importlib.import_module(ENGINES.get(getattr(args, "engine", ""), COMMANDS[args.command][0]))
    try:
        return int(module.run(args) or 0)
    except ScdError as exc:  # expected failures: one clear line, no traceback
        print(f"scd-serve {args.command}: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
