"""The vLLM connector measured against scd-serve's own engine and vLLM's own prefill (issue 44).

Run with the python of a vLLM venv that has scd-serve installed (`make test-vllm` makes
out/vllm-venv):

    out/vllm-venv/bin/python scripts/vllm_connector_check.py --producer P --consumer C \\
        --codebook BOOK --method scd --data heldout.jsonl --json out/vllm-connector.json

Starts an scd-serve prefill worker for the producer (`--prefill-engine vllm`: its prefill
computed by vLLM, so vLLM runs on both sides), then:
- quality (with --data): each record's prompt (a text's first half) through vLLM with the
  connector and through scd-serve's own rebuild (quality/transfer.py) on the same codes; the
  first generated token's distribution of each against the consumer's own prefill: KL (over
  vLLM's top-20 log-probabilities plus the rest as one bucket, the same estimator for both) and
  top-1 agreement, and the largest gap between the two engines' log-probabilities;
- TTFT: --ttft-runs prompts of --ttft-tokens random tokens, one at a time, max_tokens 1: the
  connector path against vLLM prefilling them itself (medians; both on this machine's cores),
  and the connector path again on the same prompts, answered from the prefill worker's code
  cache: the decode side's own share (link, rebuild, the tail) with the producer's prefill gone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402

from scd_serve import codec as codec_registry  # noqa: E402
from scd_serve.bench import procs  # noqa: E402
from scd_serve.model.runtime import ModelRuntime  # noqa: E402
from scd_serve.quality.data import read_prompts  # noqa: E402
from scd_serve.quality.metrics import top_kl  # noqa: E402
from scd_serve.quality.transfer import ORACLE, teacher_forced, transfer  # noqa: E402

TOP = 20


def make_llm(model: str, connector: dict | None, max_len: int, dtype: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    cfg = None if connector is None else KVTransferConfig(
        kv_connector="SCDConnector", kv_connector_module_path="scd_serve.vllm.connector", kv_role="kv_consumer",
        kv_load_failure_policy="recompute", kv_connector_extra_config=connector)
    return LLM(model=model, dtype=dtype, max_model_len=max_len, enforce_eager=True, enable_prefix_caching=False,
               kv_transfer_config=cfg, seed=0)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def first_token(llm, prompts: list[list[int]]):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0, logprobs=TOP), use_tqdm=False)
    return [o.outputs[0].logprobs[0] for o in outs]


def ttft(llm, prompts: list[list[int]]) -> float:
    """Median seconds from submit to the first (only) token, one prompt at a time."""
    from vllm import SamplingParams

    times = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 1 else times)  # the first warms up


def quality(args, connector: dict, max_len: int) -> dict:
    rt_a, rt_b = ModelRuntime.load(args.producer), ModelRuntime.load(args.consumer)
    items = read_prompts(args.data, rt_b.tokenizer, max_len - 2).items[:args.limit]
    prompts = [p.ids.tolist() for p in items]
    llm = make_llm(args.consumer, connector, max_len, args.dtype)
    try:
        got = first_token(llm, prompts)
    finally:
        close(llm)
    codec = codec_registry.build(args.method, producer=rt_a, consumer=rt_b, codebook=args.codebook or None)
    rows = {"vllm": ([], []), "scd-serve": ([], [])}
    gap = 0.0
    for ids, first in zip(prompts, got):
        p = torch.tensor(ids)
        ours = torch.log_softmax(teacher_forced(rt_b, transfer(args.method, codec, rt_a, rt_b, p[:-1], 1),
                                                p[-1:])[0].double(), -1)
        oracle = torch.log_softmax(teacher_forced(rt_b, transfer(ORACLE, None, rt_a, rt_b, p[:-1], 1),
                                                  p[-1:])[0].double(), -1)
        top = torch.tensor(sorted(first))
        theirs = torch.tensor([first[int(t)].logprob for t in top], dtype=torch.double)
        gap = max(gap, float((theirs - ours[top]).abs().max()))
        for name, lp in (("vllm", theirs), ("scd-serve", ours[top])):
            rows[name][0].append(top_kl(lp, top, oracle))
            rows[name][1].append(float(int(top[lp.argmax()]) == int(oracle.argmax())))
    return {"prompts": len(prompts), "max_logprob_gap": gap,
            **{name: {"kl": statistics.mean(kl), "top1": statistics.mean(t1)} for name, (kl, t1) in rows.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--producer", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--codebook", default="")
    p.add_argument("--method", default="scd")
    p.add_argument("--data", default="", help="JSONL of {'text'} records (a text's first half is the prompt)")
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--ttft-tokens", type=int, default=1024)
    p.add_argument("--ttft-runs", type=int, default=6)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32", help="both engines' (quality is compared in float32)")
    p.add_argument("--prefill-engine", default="scd-serve", choices=("scd-serve", "vllm"),
                   help="what computes the producer's prefill in the prefill worker (vllm: vLLM on both sides)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    port = procs.free_port()
    worker = procs.spawn([sys.executable, "-m", "scd_serve.cli", "prefill", "--model", args.producer, "--codebook",
                          args.codebook, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
                          "--insecure", "--engine", args.prefill_engine], tmp / "prefill.log")
    out: dict = {"producer": args.producer, "consumer": args.consumer, "method": args.method,
                 "prefill_engine": args.prefill_engine}
    try:
        procs.wait_tcp("127.0.0.1", port, worker, 300, log=tmp / "prefill.log")
        connector = {"prefill": [f"127.0.0.1:{port}"], "method": args.method, "codebook": args.codebook}
        if args.data:
            out["quality"] = quality(args, connector, args.max_model_len)
            print(json.dumps(out["quality"], indent=1), flush=True)
        g = torch.Generator().manual_seed(0)
        vocab = min(ModelRuntime.load(m).spec.vocab_size for m in (args.producer, args.consumer))
        prompts = [torch.randint(4, vocab, (args.ttft_tokens,), generator=g).tolist() for _ in range(args.ttft_runs)]
        times = {}
        for name, conn in (("vllm-local", None), ("vllm-connector", connector)):
            llm = make_llm(args.consumer, conn, args.max_model_len, args.dtype)
            try:
                times[name] = ttft(llm, prompts)
                if conn is not None:  # again: the producer's code cache answers, so only the decode side works
                    times["vllm-connector-cached"] = ttft(llm, prompts)
            finally:
                close(llm)
        out["ttft_s"] = times | {"tokens": args.ttft_tokens, "runs": args.ttft_runs,
                                 "connector_over_local": times["vllm-connector"] / times["vllm-local"],
                                 "cached_over_local": times["vllm-connector-cached"] / times["vllm-local"]}
        print(json.dumps(out["ttft_s"], indent=1), flush=True)
    finally:
        procs.stop(worker)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
