"""One prompt's prefill in process: scd-serve's ModelRuntime.extend against vLLM's LLM.generate
(max_tokens 1), eager or compiled, with torch.profiler's op table (issue 43: where vLLM's
prefill lead comes from). Each engine in its own python, pinned the same way:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/prefill_forward.py scd --model out/shaped/consumer
    VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 VLLM_VENV/bin/python scripts/prefill_forward.py vllm-eager \\
        --model out/shaped/consumer
    VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 VLLM_VENV/bin/python scripts/prefill_forward.py vllm \\
        --model out/shaped/consumer

scd takes the CPU's C++ kernels as a worker does (SCD_CPU_KERNELS=off: the torch path).
Prints the median of --runs after a warm-up, then (--profile) the profiler's top ops of one more.
`--layout second|passing-load` (scd) runs the forward in a second thread, the model loaded on the
main thread or in a thread that exited (model/threads.py: two OpenMP teams, or one):

    OMP_NUM_THREADS=2 .venv/bin/python scripts/prefill_forward.py scd --model out/shaped/consumer --layout second
`attention` times one layer's causal prefill attention at the shape's heads (the kernels tried
in place of SDPA's), its error against float32 SDPA:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/prefill_forward.py attention --model out/shaped/consumer
    (--only float32: SDPA and the C++ kernel in float32 alone)
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's forward in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402


def scd_prefill(model: str, dtype: str):
    from scd_serve.model.runtime import ModelRuntime

    rt = ModelRuntime.load(model, dtype=dtype)
    rt.pack_linears()
    if os.environ.get("SCD_CPU_KERNELS", "auto") != "off":  # as a serving role runs it (model/cpu_kernel.py)
        from scd_serve.model import cpu_kernel

        cpu_kernel.load()
        cpu_kernel.use(True)

    def run(ids: list[int]) -> None:
        blocks = list(range(len(ids) // 16 + 1))
        pool = rt.new_kv_pool(len(blocks), 16)
        rt.extend(pool, [(blocks, 0, torch.tensor(ids))], logits="last")
    return run


def vllm_prefill(model: str, dtype: str, eager: bool):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=8192, enforce_eager=eager, enable_prefix_caching=False, seed=0)
    return lambda ids: llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)


def attention_kernels(model: str, tokens: int, runs: int, only: list[str]) -> None:
    import math

    import torch.nn.functional as F

    from scd_serve.model.paged import attend_blocks
    from scd_serve.model.runtime import ModelRuntime

    spec = ModelRuntime.load(model, weights=False).spec
    h, kv, d, t, dt = spec.num_heads, spec.num_kv_heads, spec.head_dim, tokens, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, t, d, generator=g).to(dt) for n in (h, kv, kv))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)

    def sdpa_blocks(block: int = 256):
        return torch.cat([F.scaled_dot_product_attention(
            q[:, :, s:s + block], k[:, :, :s + block], v[:, :, :s + block], enable_gqa=True,
            attn_mask=torch.ones(block, s + block, dtype=torch.bool).tril(s)) for s in range(0, t, block)], 2)

    def bmm_blocks(block: int):  # bfloat16 GEMMs: the scores are rounded to bfloat16 before the softmax
        group, out = h // kv, torch.empty(1, h, t, d, dtype=dt)
        qg = q.view(kv, group, t, d)
        for s in range(0, t, block):
            e = min(t, s + block)
            scores = torch.bmm(qg[:, :, s:e].reshape(kv, group * (e - s), d), k[0, :, :e].transpose(1, 2)).float()
            scores = scores.mul_(1 / math.sqrt(d)).view(kv, group, e - s, e)
            scores[..., s:e].masked_fill_(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
            p = torch.softmax(scores, -1).to(dt).view(kv, group * (e - s), e)
            out[0, :, s:e] = torch.bmm(p, v[0, :, :e]).view(kv, group, e - s, d).reshape(h, e - s, d)
        return out

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, 1, 1, t, t, device="cpu")
    flex = torch.compile(flex_attention, dynamic=False)
    kernels = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
               "sdpa float32": lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                      is_causal=True, enable_gqa=True),
               "sdpa, query blocks of 256": sdpa_blocks,
               "flex_attention (inductor)": lambda: flex(q, k, v, block_mask=mask, enable_gqa=True),
               **{f"bf16 bmm, query blocks of {b}": (lambda b=b: bmm_blocks(b)) for b in (32, 64, 128)},
               # what the engine runs (model/paged.py), on [T, heads, hd] rows
               "model/paged.attend_blocks": lambda: attend_blocks(
                   q[0].transpose(0, 1), torch.arange(t), [(k[0].transpose(0, 1), v[0].transpose(0, 1), 0)],
                   None).view(t, h, d).transpose(0, 1)[None]}
    from scd_serve.model import cpu_kernel

    if cpu_kernel.unavailable_reason() is None:  # the CPU's C++ kernel (csrc/prefill_attention.cpp), both dtypes
        cpu_kernel.load()
        rows = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]  # [T, heads, hd]

        def cpp(dtype):
            qr, kr, vr = (x.to(dtype) for x in rows)
            return lambda: cpu_kernel.prefill(qr, kr[None], vr[None], torch.zeros(1, dtype=torch.long), 0,
                                              None).view(t, h, d).transpose(0, 1)[None]
        kernels |= {"C++ prefill_attention": cpp(dt), "C++ prefill_attention, float32": cpp(torch.float32)}
    for name, kernel in kernels.items():
        if only and not any(word in name for word in only):
            continue
        kernel()
        start = time.perf_counter()
        for _ in range(runs):
            out = kernel()
        print(f"{name}: {(time.perf_counter() - start) / runs * 1e3:.1f} ms a layer, "
              f"max error {float((out.float() - ref).abs().max()):.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("scd", "vllm", "vllm-eager", "attention"))
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--only", nargs="+", default=[], help="attention: the kernels whose names hold one of these words")
    p.add_argument("--layout", choices=("main", "second", "passing-load"), default="main",
                   help="scd: the model loaded and the forward run on the main thread; loaded there and run in a "
                        "second thread (two OpenMP teams); or loaded in a thread that exits, run in a second (served)")
    args = p.parse_args()
    if args.engine == "attention":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        return attention_kernels(args.model, args.tokens, args.runs, args.only)
    if args.engine == "scd":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if args.layout == "passing-load":  # as a worker serves (model/threads.py)
            from scd_serve.model.threads import in_passing_thread, one_thread

            one_thread()
            run = in_passing_thread(scd_prefill, args.model, args.dtype)
        else:
            run = scd_prefill(args.model, args.dtype)
    else:
        run = vllm_prefill(args.model, args.dtype, eager=args.engine == "vllm-eager")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (args.tokens,), generator=g).tolist() for _ in range(args.runs + 2)]
    times = []

    def timed() -> None:
        run(prompts[0])  # warm-up
        for ids in prompts[1:-1]:
            start = time.perf_counter()
            run(ids)
            times.append(time.perf_counter() - start)

    if args.layout == "main":
        timed()
    else:  # the forward in a thread of its own, as the decode worker's engine loop runs it
        thread = threading.Thread(target=timed)
        thread.start()
        thread.join()
    print(f"{args.engine} ({args.layout}): {args.tokens} tokens, {args.dtype}, median {statistics.median(times):.3f} s "
          f"of {[round(t, 3) for t in times]}", flush=True)
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            run(prompts[-1])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    os._exit(0)  # vLLM's engine threads would hold the interpreter's exit


if __name__ == "__main__":
    main()
