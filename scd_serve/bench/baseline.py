"""The baseline server for `bench serve`: transformers `generate`, one call at a time.

It speaks enough of the streamed /v1/completions for the load generator. Requests queue
FIFO and one thread runs `model.generate`: with --batch 1 one request after another, with
--batch N static batches of up to N (left-padded), each running until its longest request
is done. This is serving without continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from scd_serve.config.model import DTYPE_NAMES


BATCH_WAIT_S = 0.05  # how long the worker waits for more queued requests to fill a static batch


class _Streamer:
    """transformers streamer for a batch: the first put() is the prompts, every later one holds
    one new token per row. Row i's stream ends after its own max_tokens (the batch runs on)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outs: list[asyncio.Queue], max_tokens: list[int]):
        self.loop, self.outs, self.left = loop, outs, list(max_tokens)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for i, tok in enumerate(value.reshape(-1).tolist()):
            if self.left[i] > 0:
                self.left[i] -= 1
                self.loop.call_soon_threadsafe(self.outs[i].put_nowait, int(tok))
                if self.left[i] == 0:
                    self.loop.call_soon_threadsafe(self.outs[i].put_nowait, None)

    def end(self) -> None:  # after the batch, or a failure: close the streams still open
        for i, out in enumerate(self.outs):
            if self.left[i] > 0:
                self.left[i] = 0
                self.loop.call_soon_threadsafe(out.put_nowait, None)


def take_batch(jobs: queue.Queue, size: int) -> list:
    """The first queued job (waiting for it), then up to size-1 more arriving within BATCH_WAIT_S."""
    batch = [jobs.get()]
    deadline = time.monotonic() + BATCH_WAIT_S
    while len(batch) < size:
        try:
            batch.append(jobs.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            break
    return batch


def create_app(model_dir: str, threads: int | None = None, batch: int = 1, device: str = "cpu",
               dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs: queue.Queue = queue.Queue()

    def worker() -> None:  # the one place generate runs: one call (one batch) at a time
        while True:
            jobs_now = take_batch(jobs, batch)
            loop = jobs_now[0][2]
            width = max(len(ids) for ids, _, _, _ in jobs_now)
            input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _, _, _ in jobs_now],
                                     device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _, _ in jobs_now],
                                device=device)
            longest = max(m for _, m, _, _ in jobs_now)
            streamer = _Streamer(loop, [out for _, _, _, out in jobs_now], [m for _, m, _, _ in jobs_now])
            try:
                with torch.inference_mode():
                    model.generate(input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                   do_sample=False, streamer=streamer, pad_token_id=0)
            except Exception:  # a failed request must not kill the worker
                pass
            finally:
                streamer.end()

    threading.Thread(target=worker, daemon=True, name="generate").start()
    app = FastAPI(title="sequential generate baseline")

    @app.get("/ready")
    async def ready():
        return {"ready": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) else tokenizer(str(prompt or ""))["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        if not ids or max_tokens < 1:
            return JSONResponse({"error": {"type": "invalid_request_error", "message": "empty prompt"}}, 400)
        out: asyncio.Queue = asyncio.Queue()
        jobs.put((ids, max_tokens, asyncio.get_running_loop(), out))
        created, rid = int(time.time()), f"base-{id(out):x}"

        async def events():
            n = 0
            while (tok := await out.get()) is not None:
                n += 1
                text = tokenizer.decode([tok])
                yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': created, 'choices': [{'index': 0, 'text': text, 'finish_reason': None}]})}\n\n"
            final = {"id": rid, "object": "text_completion", "created": created,
                     "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": n}}
            yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int)
    p.add_argument("--batch", type=int, default=1, help="static batch size (1 = strictly sequential)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    a = p.parse_args()
    if a.batch < 1:
        p.error("--batch must be >= 1")
    import uvicorn

    print(f"generate baseline: {a.model} on {a.device} in {a.dtype}, static batches of {a.batch}", flush=True)
    uvicorn.run(create_app(a.model, a.threads, a.batch, a.device, a.dtype), host=a.host, port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
