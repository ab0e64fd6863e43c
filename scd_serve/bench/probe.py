"""The decode side of `bench ttft`: a consumer that pulls codes over real gRPC and times it.

Runs as its own process (inside the consumer namespace when there is one) and takes
commands as JSON lines on stdin, answering one JSON line each on stdout, so the model
loads once while the driver re-shapes the link between sweep points.

Per request it times, on this side: the first and last chunk's arrival, the rebuild
(its prompt-only preparation, done while the first chunk is on its way, plus decode_layer
and the KV write of every layer as its chunk arrives; all of it counts in the bound), and
the first decode step on the last prompt token. TTFT = send -> first token.
The oracle is this consumer's own prefill of the whole prompt (no transfer).

    python -m scd_serve.bench.probe --consumer DIR [--codebook DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid

import torch

from scd_serve.decode.codecs import PromptCodec
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb
from scd_serve.transport.tensors import decode_code

BLOCK = 16


class Probe:
    def __init__(self, consumer_dir: str, codebook: str | None):
        from scd_serve.decode.codecs import ConsumerCodecs
        from scd_serve.model import ModelRuntime

        self.rt = ModelRuntime.load(consumer_dir)
        self.codecs = ConsumerCodecs(self.rt, codebook or "")  # what the decode worker builds
        self.clients: dict = {}
        self.num_cold = 0  # cold prompts never repeat within this process (no code-cache hit)

    async def client(self, address: str):
        if address not in self.clients:
            from scd_serve.config.transport import TransportConfig
            from scd_serve.transport.client import PrefillClient

            c = PrefillClient(address, TransportConfig(prefill_timeout_s=600.0))
            info = await c.info(timeout=30.0)
            self.clients[address] = (c, info)
        return self.clients[address]

    def prompt(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        hi = min(self.rt.spec.vocab_size, 30000)
        return [rng.randrange(3, hi) for _ in range(n)]

    def oracle(self, ids: list[int]) -> dict:
        """Consumer's own prefill; its last logits give the first token."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.rt.prefill(torch.tensor(ids, dtype=torch.long), capture=False)
            int(out.logits[-1].argmax())
        return {"ttft_s": time.perf_counter() - t0, "payload_bytes": 0}

    async def transfer(self, address: str, method: str, ids: list[int], rpc: str = "session") -> dict:
        client, info = await self.client(address)
        codec = self.codecs.get(info, method)
        shipped, last = ids[:-1], ids[-1]  # the last prompt token is the first decode step
        spec = self.rt.spec
        pool = self.rt.new_kv_pool(-(-len(ids) // BLOCK) + 1, BLOCK)
        blocks = list(range(pool.num_blocks))
        rid = uuid.uuid4().hex[:16]
        verifier = StreamVerifier(rid, method, len(shipped), spec.num_layers,
                                  check_header=lambda h: _check_version(h, method, codec))
        req = pb.PrefillRequest(request_id=rid, token_ids=shipped, method=method,
                                consumer_fingerprint=self.rt.fingerprint, timeout_ms=600_000)
        rebuild = producer_us = payload = 0.0
        t_first_chunk = t_last_chunk = None
        t0 = time.perf_counter()
        # a pooled session, as the decode worker uses; "call": one Prefill RPC (to compare)
        call = (client.transfer if rpc == "session" else client.prefill)(req, timeout=600.0)
        prompt_codec = PromptCodec(codec, shipped)
        with torch.inference_mode():
            try:
                if rpc == "session":  # the request is out: prompt-only work overlaps the answer
                    await call.send()
                p0 = time.perf_counter()  # as the decode worker's RemoteKVFill._prepare
                writer = self.rt.kv_writer(pool, blocks, len(shipped))
                prompt_codec.prepare(self.rt)
                rebuild += time.perf_counter() - p0
                async for msg in call:
                    now = time.perf_counter()
                    chunk = verifier.on_message(msg)
                    if chunk is None:
                        continue
                    t_first_chunk = t_first_chunk or now
                    t_last_chunk = now
                    producer_us += chunk.encode_us
                    payload += sum(len(t.data) for t in chunk.tensors)
                    r0 = time.perf_counter()
                    for layer in range(chunk.layer_start, chunk.layer_end):
                        k_pre, v = prompt_codec.decode_layer(layer, decode_code(chunk.tensors, layer), self.rt)
                        writer.write(layer, k_pre, v)  # k_pre: [T-1, kvh, hd]
                    rebuild += time.perf_counter() - r0
            except BaseException:
                call.cancel()  # the session is not reused
                raise
            verifier.finish()
            cache_hit = verifier.header.cache_hit
            t_rebuilt = time.perf_counter()
            logits = self.rt.decode_step(pool, [(blocks, len(shipped), last)])  # [1, vocab]
            int(logits[0].argmax())
        t_first = time.perf_counter()
        return {"ttft_s": t_first - t0, "payload_bytes": payload, "cache_hit": cache_hit,
                "producer_s": producer_us / 1e6, "first_chunk_s": t_first_chunk - t0,
                "recv_s": t_last_chunk - t0,
                # time to all bytes not explained by producer compute (request, queueing, the link)
                "wire_s": max(0.0, t_last_chunk - t0 - producer_us / 1e6),
                "rebuild_s": rebuild, "rebuild_tail_s": t_rebuilt - t_last_chunk,
                "first_step_s": t_first - t_rebuilt}

    async def run(self, cmd: dict) -> dict:
        rows, rpc = [], cmd.get("rpc", "session")
        for n in cmd["prompt_tokens"]:
            for method in cmd["methods"]:
                if method == "oracle":
                    ids = self.prompt(n, cmd["seed"])
                    self.oracle(ids)  # warm-up
                    samples = [self.oracle(self.prompt(n, cmd["seed"] + r)) for r in range(cmd["reps"])]
                    rows.append({"method": method, "prompt_tokens": n, "mode": "local", "samples": samples})
                    continue
                # one uncounted transfer first: first-call costs (codec tables, allocations) are not TTFT
                self.num_cold += 1
                await self.transfer(cmd["prefill"], method, self.prompt(n, (cmd["seed"] + 1) * 1_000_003 + self.num_cold), rpc)
                for mode in cmd["modes"]:
                    samples = []
                    if mode == "warm":  # one uncounted request fills the producer's code cache
                        warm_ids = self.prompt(n, cmd["seed"])
                        await self.transfer(cmd["prefill"], method, warm_ids, rpc)
                    for r in range(cmd["reps"]):
                        self.num_cold += mode == "cold"
                        ids = warm_ids if mode == "warm" else self.prompt(n, (cmd["seed"] + 1) * 1_000_003 + self.num_cold)
                        samples.append(await self.transfer(cmd["prefill"], method, ids, rpc))
                    rows.append({"method": method, "prompt_tokens": n, "mode": mode, "samples": samples})
        return {"rows": rows}


def _check_version(header, method: str, codec) -> None:
    if header.codec_version != codec.version:
        raise RuntimeError(f"{method}: producer codec {header.codec_version} != {codec.version}")


async def serve(probe: Probe) -> None:
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": True, "consumer_fingerprint": probe.rt.fingerprint}), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            answer = await probe.run(cmd)
        except Exception as exc:  # reported to the driver, which decides what to do
            answer = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(answer), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--consumer", required=True)
    p.add_argument("--codebook")
    a = p.parse_args()
    torch.set_num_threads(1)
    asyncio.run(serve(Probe(a.consumer, a.codebook)))


if __name__ == "__main__":
    main()
