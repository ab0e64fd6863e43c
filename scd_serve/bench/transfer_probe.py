"""The decode side of `bench ttft`: a consumer that pulls codes over real gRPC and times it.

Its own process (in the consumer namespace when there is one), driven by JSON lines on
stdin, so the model loads once while the driver re-shapes the link between sweep points.
Per request it runs the decode worker's receive loop (decode/receive.py) in a transfer
thread, with the first decode step run a layer at a time as the K/V lands
(engine/step_ahead.py), and times the first and last chunk, the rebuild (prompt-only
preparation, decode_layer and the KV write of each layer) and the first step. On a GPU a
layer's times measure when its work was queued. TTFT = hand-off to the transfer thread ->
first token; the oracle is this consumer's own prefill. With a `worker` URL (`bench ttft
--worker`) it times a real `scd-serve decode` instead: streamed /v1/completions with
max_tokens=1, send -> first token event.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from scd_serve.bench.loadgen import answer_commands, random_prompt, stream_completion, wait_ready
from scd_serve.codec.rebuild import begin, codes_from
from scd_serve.decode.receive import drain, receive
from scd_serve.engine.step_ahead import StepAhead
from scd_serve.errors import TransferFailed
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb

BLOCK = 16


class Probe:
    def __init__(self, consumer_dir: str, codebook: str | None):
        from scd_serve.decode.consumer_codecs import ConsumerCodecs
        from scd_serve.model import ModelRuntime

        self.rt = ModelRuntime.load(consumer_dir)
        self.codecs = ConsumerCodecs(self.rt, codebook or "")  # what the decode worker builds
        self.clients: dict = {}
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="probe-transfer")
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
        return random_prompt(self.rt.spec.vocab_size, n, seed)

    def cold_prompt(self, n: int, seed: int) -> list[int]:
        self.num_cold += 1
        return self.prompt(n, (seed + 1) * 1_000_003 + self.num_cold)

    def oracle(self, ids: list[int]) -> dict:
        """Consumer's own prefill; its last logits give the first token."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.rt.prefill(torch.tensor(ids, dtype=torch.long), capture=False)
            int(out.logits[-1].argmax())
        return {"ttft_s": time.perf_counter() - t0, "payload_bytes": 0}

    async def transfer(self, address: str, method: str, ids: list[int]) -> dict:
        client, info = await self.client(address)
        codec = self.codecs.get(info, method)
        t0 = time.perf_counter()
        req = pb.PrefillRequest(request_id=uuid.uuid4().hex[:16], token_ids=ids[:-1], method=method,
                                start=codes_from(codec, 0, len(ids) - 1),  # after the codec's head
                                consumer_fingerprint=self.rt.fingerprint, timeout_ms=600_000)
        call = client.stream(req, timeout=600.0)  # as the decode worker: the request leaves, then a thread reads
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.thread, self._transfer, call, codec, method, ids, t0, req.request_id)
        except BaseException:
            call.cancel()  # the prefill worker stops now, not at the deadline
            raise

    def _transfer(self, call, codec, method: str, ids: list[int], t0: float, rid: str) -> dict:
        """Transfer thread: the decode worker's receive loop, the first decode step run ahead as each
        layer lands (as the engine's runner does)."""
        shipped, last = ids[:-1], ids[-1]  # the last prompt token is the first decode step
        pool = self.rt.new_kv_pool(-(-len(ids) // BLOCK) + 1, BLOCK)
        blocks = list(range(pool.num_blocks))
        verifier = StreamVerifier(rid, method, len(shipped) - codes_from(codec, 0, len(shipped)), self.rt.spec.num_layers,
                                  check_header=lambda h: _check_version(h, method, codec))
        rebuild = begin(codec, shipped, self.rt)
        writer, logits = [], []
        ahead = StepAhead(lambda: self.rt.begin_decode_step(pool, [(blocks, len(shipped), last)]),
                          self.rt.spec.num_layers, logits.append, request_id=rid)

        def prepare() -> None:  # as the worker's sink.prepare + codec.prepare
            writer.append(self.rt.kv_writer(pool, blocks, len(shipped)))
            ahead.start()
            rebuild.prepare()

        def rebuild_layer(layer: int, code: dict) -> None:
            k_pre, v = rebuild.decode_layer(layer, code)  # [T-1, kvh, hd]
            writer[0].write(layer, k_pre, v)
            ahead.landed(layer)

        with torch.inference_mode():
            got = receive(call, verifier, prepare, rebuild_layer)
            if not logits:
                raise TransferFailed(f"{method}: the first step made ahead of the fill failed (see the log)")
            int(logits[0].argmax())
        t_first = time.perf_counter()
        if why := drain(call):  # the stream's end, after the first token as in the worker
            raise TransferFailed(f"{method}: after its last chunk: {why}")
        return {"ttft_s": t_first - t0, "payload_bytes": got.payload_bytes, "cache_hit": got.cache_hit,
                "producer_s": got.encode_us / 1e6, "first_chunk_s": got.first_chunk_at - t0,
                "recv_s": got.last_chunk_at - t0,
                # time to all bytes not explained by producer compute (request, queueing, the link)
                "wire_s": max(0.0, got.last_chunk_at - t0 - got.encode_us / 1e6),
                "rebuild_s": got.rebuild_s - ahead.elapsed_s,  # the K/V alone: the step ran inside it
                "rebuild_tail_s": t_first - got.last_chunk_at,  # all that was left after the last byte
                # the whole step (setup, layers, head) wherever it ran, and the argmax
                "first_step_s": ahead.elapsed_s + (t_first - got.rebuilt_at)}

    async def through_worker(self, cmd: dict) -> dict:
        """Warm TTFT of the decode worker at cmd["worker"] over HTTP, per method and length;
        one uncounted request per (method, length) first fills the producer's code cache."""
        url, timeout = cmd["worker"], cmd.get("request_timeout_s", 120.0)
        rows = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
            await wait_ready(client, url, cmd.get("ready_timeout_s", 120.0))
            for n in cmd["prompt_tokens"]:
                for method in cmd["methods"]:
                    body = {"prompt": self.prompt(n, cmd["seed"]), "max_tokens": 1, "temperature": 0.0,
                            "ignore_eos": True, "scd_method": method}
                    samples = []
                    for r in range(cmd["reps"] + 1):
                        res = await stream_completion(client, url, body, timeout)
                        if not res.ok:
                            raise TransferFailed(f"decode worker, method {method}: {res.error or 'no token'}")
                        if r:
                            samples.append({"ttft_s": res.ttft})
                    rows.append({"method": method, "prompt_tokens": n, "mode": "warm", "samples": samples})
        return {"rows": rows}

    async def run(self, cmd: dict) -> dict:
        if "worker" in cmd:
            return await self.through_worker(cmd)
        rows = []
        for n in cmd["prompt_tokens"]:
            for method in cmd["methods"]:
                if method == "oracle":
                    ids = self.prompt(n, cmd["seed"])
                    self.oracle(ids)  # warm-up
                    samples = [self.oracle(self.prompt(n, cmd["seed"] + r)) for r in range(cmd["reps"])]
                    rows.append({"method": method, "prompt_tokens": n, "mode": "local", "samples": samples})
                    continue
                # one uncounted transfer first: first-call costs (codec tables, allocations) are not TTFT
                await self.transfer(cmd["prefill"], method, self.cold_prompt(n, cmd["seed"]))
                for mode in cmd["modes"]:
                    samples = []
                    if mode == "warm":  # one uncounted request fills the producer's code cache
                        warm_ids = self.prompt(n, cmd["seed"])
                        await self.transfer(cmd["prefill"], method, warm_ids)
                    for r in range(cmd["reps"]):
                        ids = warm_ids if mode == "warm" else self.cold_prompt(n, cmd["seed"])
                        samples.append(await self.transfer(cmd["prefill"], method, ids))
                    rows.append({"method": method, "prompt_tokens": n, "mode": mode, "samples": samples})
        return {"rows": rows}


def _check_version(header, method: str, codec) -> None:
    if header.codec_version != codec.version:
        raise RuntimeError(f"{method}: producer codec {header.codec_version} != {codec.version}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--consumer", required=True)
    p.add_argument("--codebook")
    a = p.parse_args()
    torch.set_num_threads(1)
    probe = Probe(a.consumer, a.codebook)
    asyncio.run(answer_commands({"ready": True, "consumer_fingerprint": probe.rt.fingerprint}, probe.run))


if __name__ == "__main__":
    main()
