#!/usr/bin/env python3
"""Regenerate the committed gRPC modules, scd_serve/_proto/, from proto/scd/v1/scd.proto.

    python scripts/gen_proto.py           # rewrite scd_serve/_proto (what `make proto` runs)
    python scripts/gen_proto.py --check   # exit 1 if a fresh generation differs from it

Needs grpcio-tools (the test extra), at the version in constraints.txt: protoc writes its
version into the code, so another version gives other bytes (and other runtime floors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's scd_serve, installed or not

from scd_serve.transport.proto_build import differences, generate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args()
    if args.check:
        diff = differences()
        for path in diff:
            print(f"{path.relative_to(ROOT)} differs from a fresh generation: run `make proto`")
        return 1 if diff else 0
    for path in generate():
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
