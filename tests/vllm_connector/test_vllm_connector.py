"""SCDConnector inside a real vLLM engine (its CPU build), fed by real `scd-serve prefill`
processes over gRPC. Run by `make test-vllm` in vLLM's own venv; skipped where vLLM is not
installed (the main suite's venv), failing instead with SCD_REQUIRE_VLLM=1.

A tiny Qwen2 pair of random weights (head size 32: vLLM's CPU attention needs >= 32) and a
codebook fitted in seconds: its quality means nothing, so the checks are equalities: vLLM's
own prefill against the connector with the consumer's own K/V (identity), and the connector's
scd rebuild against scd-serve's own engine path on the same codes.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("SCD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from scd_serve import codec as codec_registry  # noqa: E402
from scd_serve.bench import procs  # noqa: E402
from scd_serve.model.runtime import ModelRuntime  # noqa: E402
from scd_serve.model.tiny import save_tiny_model  # noqa: E402
from scd_serve.quality.metrics import top_kl  # noqa: E402
from scd_serve.quality.transfer import ORACLE, greedy_after, teacher_forced, transfer  # noqa: E402
from scd_serve.testing.codebooks import quick_codebook  # noqa: E402

pytestmark = pytest.mark.timeout(600)
HERE = Path(__file__).parent
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             num_hidden_layers=4, vocab_size=512, max_position_embeddings=2048)
MAX_TOKENS = 8
TOP = 20  # log-probabilities vLLM returns per token


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    a = save_tiny_model(root / "producer", "qwen2", seed=0, **SHAPE)
    b = save_tiny_model(root / "consumer", "qwen2", seed=1, **SHAPE)
    book = quick_codebook(ModelRuntime.load(a), ModelRuntime.load(b), root / "codebook", patch=(2,), replay=4,
                          head=6)
    return a, b, book


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 500, (int(torch.randint(20, 300, (1,), generator=g)),), generator=g).tolist()
            for _ in range(20)]


class Prefill:
    """An scd-serve prefill worker process (or `script`'s stand-in) on 127.0.0.1; engine "vllm":
    its producer's prefill computed by vLLM (`--engine vllm`)."""

    def __init__(self, tmp: Path, model: Path, codebook: str = "", script: Path | None = None,
                 engine: str = "scd-serve"):
        self.port, self.metrics_port = procs.free_port(), procs.free_port()
        self.log = tmp / f"prefill-{self.port}.log"
        cmd = ([sys.executable, str(script), str(model), str(self.port)] if script else
               [sys.executable, "-m", "scd_serve.cli", "prefill", "--model", str(model), "--codebook", codebook,
                "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                "--insecure", "--engine", engine])
        self.proc = procs.spawn(cmd, self.log)
        procs.wait_tcp("127.0.0.1", self.port, self.proc, 120, log=self.log)
        self.address = f"127.0.0.1:{self.port}"

    def served(self, method: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        m = re.search(rf'scd_prefill_transfers_total{{method="{method}",outcome="served"}} (\S+)', text)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        procs.stop(self.proc)


def generate(model: Path, prompts, connector: dict | None, logprobs: int | None = None):
    cfg = None if connector is None else KVTransferConfig(
        kv_connector="SCDConnector", kv_connector_module_path="scd_serve.vllm.connector", kv_role="kv_consumer",
        kv_load_failure_policy="recompute", kv_connector_extra_config=connector)
    llm = LLM(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True,
              enable_prefix_caching=False, kv_transfer_config=cfg, seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=logprobs, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("engine", ["scd-serve", "vllm"])
def test_identity_codes_equal_vllms_own_prefill(pair, prompts, tmp_path, engine):
    """Same model on both sides: the connector's K/V is the consumer's own, so vLLM's greedy
    output equals its own prefill's, token for token, and every prompt was transferred; with
    engine "vllm" the prefill worker's K/V is vLLM's too (a cluster of vLLM on both sides)."""
    _, consumer, _ = pair
    worker = Prefill(tmp_path, consumer, engine=engine)
    try:
        own = generate(consumer, prompts, None)
        got = generate(consumer, prompts, {"prefill": [worker.address], "method": "identity"})
        assert worker.served("identity") == len(prompts)
    finally:
        worker.stop()
    assert [o.token_ids for o in got] == [o.token_ids for o in own]


@pytest.mark.parametrize("engine", ["scd-serve", "vllm"])
def test_scd_codes_match_scd_serves_own_engine(pair, prompts, tmp_path, engine):
    """A cross-model pair: vLLM's first-token log-probabilities after the connector's scd rebuild
    are scd-serve's own rebuild's (same codes, same codebook, replayed tail, head and Patch layer),
    its greedy tokens too; both measured against the consumer's own prefill (KL, top-1). With
    engine "vllm" the codes are encoded from vLLM's prefill of the producer."""
    producer, consumer, book = pair
    worker = Prefill(tmp_path, producer, book, engine=engine)
    try:
        got = generate(consumer, prompts, {"prefill": [worker.address], "method": "scd", "codebook": book},
                       logprobs=TOP)
        assert worker.served("scd") == len(prompts)
    finally:
        worker.stop()
    rt_a, rt_b = ModelRuntime.load(producer), ModelRuntime.load(consumer)
    codec = codec_registry.build("scd", producer=rt_a, consumer=rt_b, codebook=book)
    worst, ours_kl, vllm_kl, ours_top1, vllm_top1 = 0.0, [], [], [], []
    for prompt, out in zip(prompts, got):
        p = torch.tensor(prompt)
        ref = transfer("scd", codec, rt_a, rt_b, p[:-1], MAX_TOKENS)
        logits = teacher_forced(rt_b, ref, p[-1:])[0]
        ours = torch.log_softmax(logits.double(), -1)
        assert out.token_ids == greedy_after(rt_b, ref, logits, MAX_TOKENS, stop_id=-1)
        first = out.logprobs[0]  # {token: Logprob}, the top TOP of vLLM's first-token distribution
        worst = max(worst, max(abs(lp.logprob - float(ours[t])) for t, lp in first.items()))
        oracle = torch.log_softmax(teacher_forced(rt_b, transfer(ORACLE, None, rt_a, rt_b, p[:-1], 1), p[-1:])[0]
                                   .double(), -1)
        top = torch.tensor(sorted(first))  # KL over vLLM's top tokens, the rest as one bucket, for both
        for kls, top1s, lp in ((ours_kl, ours_top1, ours[top]),
                               (vllm_kl, vllm_top1, torch.tensor([first[int(t)].logprob for t in top]))):
            kls.append(top_kl(lp, top, oracle))
            top1s.append(int(top[lp.argmax()]) == int(oracle.argmax()))
    assert worst < 2e-3, f"vLLM's first-token log-probabilities differ from scd-serve's by up to {worst:.2e}"
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert abs(mean(vllm_kl) - mean(ours_kl)) <= 0.01 * mean(ours_kl)
    assert abs(mean(vllm_top1) - mean(ours_top1)) <= 0.01
    print(f"\nscd ({engine} producer) over {len(prompts)} prompts: KL vLLM {mean(vllm_kl):.5f} / "
          f"scd-serve {mean(ours_kl):.5f}, "
          f"top-1 {mean(vllm_top1):.3f} / {mean(ours_top1):.3f}, worst log-probability gap {worst:.1e}")


def test_worker_killed_mid_transfer_vllm_recomputes(pair, prompts, tmp_path):
    """The only prefill worker exits in the middle of the first transfer's stream: the load fails,
    vLLM recomputes the prompt itself (kv_load_failure_policy "recompute") and answers as its
    own prefill does; the prompts after it, with no worker left, fail fast and are recomputed too."""
    _, consumer, _ = pair
    worker = Prefill(tmp_path, consumer, script=HERE / "dying_prefill.py")
    try:
        own = generate(consumer, prompts[:4], None)
        got = generate(consumer, prompts[:4], {"prefill": [worker.address], "method": "identity",
                                               "rpc_timeout_s": 2})
        assert worker.proc.wait(timeout=30) == 1  # it died mid-stream, as the script makes it
    finally:
        worker.stop()
    assert [o.token_ids for o in got] == [o.token_ids for o in own]
