"""The prefill worker as `bench ttft` runs it: `scd-serve prefill`, optionally with another chunk size.

The worker resends cached codes (warm requests) with the first and the last layer alone and
the layers between packed into chunks of up to `chunk_bytes` (32 KiB by default,
`scd_serve/config/prefill.py`); the cold path streams one layer per chunk as the producer
finishes it. `--chunk-bytes N` overrides the resend size (1 = one
layer per chunk, to compare); 0 keeps the worker default. Everything else is the unchanged
worker (`scd_serve.prefill.main.serve`).

    python -m scd_serve.bench.prefill_worker --chunk-bytes 0 -- <scd-serve prefill arguments>
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys


def main(argv: list[str] | None = None) -> int:
    from scd_serve.control.lifecycle import setup_logging
    from scd_serve.prefill import main as prefill_main

    argv = sys.argv[1:] if argv is None else argv
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    own.add_argument("--chunk-bytes", type=int, default=0, help="0 = the worker's default")
    mine, rest = own.parse_known_args(argv)
    parser = argparse.ArgumentParser(prog="scd-serve prefill")
    prefill_main.add_arguments(parser)
    config = prefill_main.config_from_args(parser.parse_args([a for a in rest if a != "--"]))
    if mine.chunk_bytes > 0:
        config = dataclasses.replace(config, chunk_bytes=mine.chunk_bytes)
    setup_logging("prefill")
    asyncio.run(prefill_main.serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
