"""Several experts fed by one prefill pool: a producer serves two consumers (fine-tunes of it),
each with its own codebook, over real gRPC. Each decode side is sent the codes of its own
codebook; a prompt both read is prefilled once (the second is served from the code cache)."""

import pytest

from scd_serve import codec as codec_registry
from scd_serve.codec.codebook import Codebook
from scd_serve.config.prefill import PrefillConfig
from scd_serve.config.transport import TransportConfig
from scd_serve.errors import IncompatiblePeer
from scd_serve.prefill.worker import PrefillWorker
from scd_serve.testing.codebooks import quick_codebook
from scd_serve.transport.proto import pb

from serving_helpers import engine_for, greedy, make_decode, prompts, settled, tiny_runtime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    base = tiny_runtime(root / "base", seed=0)
    coder, writer = tiny_runtime(root / "coder", seed=1), tiny_runtime(root / "writer", seed=2)
    return base, {"coder": (coder, quick_codebook(base, coder, root / "coder-book")),
                  "writer": (writer, quick_codebook(base, writer, root / "writer-book"))}


async def test_one_prefill_pool_feeds_two_experts_each_its_own_codes(experts):
    base, by_name = experts
    build = lambda book: {"scd": codec_registry.build("scd", producer=base, codebook=Codebook.load(book))}  # noqa: E731
    node = PrefillWorker(base, build(by_name["coder"][1]), PrefillConfig(model="unused", port=0,
                                                                         transport=TransportConfig()),
                         experts=[build(by_name["writer"][1])])
    await node.start()
    sides = {}
    try:
        for name, (rt, book) in by_name.items():
            sides[name] = (*await make_decode(rt, [node.address], method="scd", codebook=book),
                           engine_for(rt, prefix_caching=False))
        info = sides["coder"][0].peers[node.address].info
        assert sorted(c.codebook_id for c in info.codecs if c.codec_id == "scd") == sorted(
            Codebook.load(book).manifest["tensors_sha256"][:16] for _, book in by_name.values())
        prompt = prompts(1, seed=4)[0] + prompts(1, seed=5)[0]
        answers = {}
        for name, (peers, fill, engine) in sides.items():  # the same prompt, coder first
            assert peers.ready(), peers.status()
            answers[name] = await greedy(engine, name, prompt, "scd", fill)
        assert node.servicer.num_prefills == 1  # the writer's codes were made by the coder's prefill
        assert sides["coder"][1].stats.num_cache_hits == 0 and sides["writer"][1].stats.num_cache_hits == 1
        assert await settled(node, 2)
        for name, (rt, book) in by_name.items():  # each the codes of its own codebook: as a pool of one
            alone = PrefillWorker(base, build(book), PrefillConfig(model="unused", port=0, transport=TransportConfig()))
            await alone.start()
            peers, fill = await make_decode(rt, [alone.address], method="scd", codebook=book)
            try:
                assert await greedy(sides[name][2], f"{name}-alone", prompt, "scd", fill) == answers[name]
            finally:
                await peers.close()
                await alone.stop()
    finally:
        for peers, _, engine in sides.values():
            await engine.stop(grace_s=1)
            await peers.close()
        await node.stop()


async def test_a_consumer_without_a_codebook_here_is_refused_by_name(experts):
    base, by_name = experts
    coder_book = by_name["coder"][1]
    servicer = PrefillWorker(base, {"scd": codec_registry.build("scd", producer=base, codebook=Codebook.load(coder_book))},
                             PrefillConfig(model="unused", port=0, transport=TransportConfig())).servicer
    writer_fp = by_name["writer"][0].fingerprint
    request = pb.PrefillRequest(request_id="x", method="scd", consumer_fingerprint=writer_fp, start=0)
    with pytest.raises(IncompatiblePeer, match="no codebook of 'scd' here is for consumer"):
        servicer._admit(request, [1, 2, 3])
