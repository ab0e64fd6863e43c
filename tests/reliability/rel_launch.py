"""Run an `scd-serve` command with fault seams from scd_serve.testing.faults composed in (tests only).

    python tests/reliability/rel_launch.py [--prefill-layer-delay S] [--prefill-exit-at-chunk N]
        [--decode-fail-after-steps N] [--decode-step-delay S] -- prefill --model DIR --port 0 ...

The seams wrap the model runtime or the prefill servicer the command builds; the command's
own code (CLI, config, signals, shutdown) runs unchanged.
"""

import argparse
import sys


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--prefill-layer-delay", type=float, default=0.0)
    p.add_argument("--prefill-exit-at-chunk", type=int, default=None)
    p.add_argument("--decode-fail-after-steps", type=int, default=None)
    p.add_argument("--decode-step-delay", type=float, default=0.0)
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]

    from scd_serve.testing import faults
    from scd_serve.model import runtime as runtime_mod

    real_load = runtime_mod.ModelRuntime.load.__func__
    role = command[0]

    def load(cls, *a, **kw):
        rt = real_load(cls, *a, **kw)
        if role == "prefill" and args.prefill_layer_delay:
            return faults.FaultyProducer(rt, layer_delay_s=args.prefill_layer_delay)
        if role == "decode" and (args.decode_fail_after_steps is not None or args.decode_step_delay):
            return faults.FaultyRuntime(rt, fail_after_steps=args.decode_fail_after_steps,
                                        stall_after_steps=0 if args.decode_step_delay else None,
                                        stall_s=args.decode_step_delay)
        return rt

    runtime_mod.ModelRuntime.load = classmethod(load)
    if args.prefill_exit_at_chunk is not None:
        from scd_serve.prefill import service
        real_cls = service.PrefillServicer
        service.PrefillServicer = lambda *a, **kw: faults.FaultyServicer(real_cls(*a, **kw),
                                                                        exit_at_chunk=args.prefill_exit_at_chunk)
    from scd_serve.cli import main as cli_main
    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main())
