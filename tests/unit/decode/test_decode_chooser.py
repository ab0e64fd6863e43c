"""The `auto` method's chooser on a fake clock, fed fake measurements (no timing)."""

import pytest

from scd_serve.config.decode import ChooserConfig, DecodeConfig
from scd_serve.config.methods import LOCAL
from scd_serve.decode.chooser import Chooser, PeerView, method_kl, prompt_key
from scd_serve.errors import ConfigError

# the demo pair's manifest (calibration.methods.*.kl): scd and scd-int8 within 0.05, reuse and raw not
KL = {"scd": 0.0486, "scd-int8": 0.0491, "reuse": 0.0557, "raw": 7.38, "quant4": 7.42}
RATIO = {"scd": 0.273, "scd-int8": 0.137, "reuse": 0.27, "raw": 1.0, "quant4": 0.316}
RAW_PER_TOKEN = 1024  # bytes of 16-bit K+V per token (8 layers, 2 kv heads of 16)
N = 1024
PEER = "10.0.0.1:5000"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class World:
    """A fake link and CPU: what each option would take, reported as the worker reports it."""

    def __init__(self, rate, local_s_per_token=60e-6, rebuild=None, overhead_s=0.003):
        self.rate = rate  # bytes/s
        self.local = local_s_per_token
        self.rebuild = rebuild or {"scd": 10e-6, "scd-int8": 11e-6, "reuse": 9e-6}
        self.overhead = overhead_s
        self.num = 0

    def serve(self, chooser, choice, key=1, n=N, cached=True, producer_s_per_token=50e-6):
        """Run `choice` in this world; tell the chooser; -> its prediction error."""
        self.num += 1
        if choice.method == LOCAL:
            return chooser.observe_outcome(choice, n, self.local * n)
        payload = RATIO[choice.method] * RAW_PER_TOKEN * n
        wire, rebuild = payload / self.rate, self.rebuild[choice.method] * n
        producer = 0.0 if cached else producer_s_per_token * n
        took = max(wire, rebuild, producer)
        measured = chooser.observe_transfer(choice.peer, choice.method, key, n, payload_bytes=int(payload),
                                            rebuild_s=rebuild, producer_s=producer, cache_hit=cached, wall_s=took,
                                            link_bytes=int(payload), link_s=took, link_bound=cached and wire > rebuild)
        return chooser.observe_outcome(choice, n, took + self.overhead, measured)


def make(clock=None, **cfg):
    config = ChooserConfig(**({"stale_s": 30.0} | cfg))
    return Chooser(config, budget=0.05, raw_bytes_per_token=RAW_PER_TOKEN, payload_ratio=RATIO, clock=clock or Clock())


def peer(**kw):
    return PeerView(PEER, method_kl("prod", "cons", KL, "prod"), **kw)


def warmed(world, chooser, requests=6, key=1):
    """Serve `requests` requests, warm at the peer: the exploration is over after three."""
    picks = []
    for _ in range(requests):
        c = chooser.choose(key, N, [peer()])
        world.serve(chooser, c, key)
        picks.append(c)
    return picks


def test_method_kl_and_the_budget():
    assert method_kl("prod", "cons", KL, "prod") == KL
    assert method_kl("other", "cons", KL, "prod") == {}  # the codebook was calibrated for another producer
    same = method_kl("m", "m", {}, "")
    assert same == {"identity": 0.0, "raw": 0.0}  # lossless only where producer == consumer
    assert make().allowed(peer()) == ["scd-int8", "scd"]  # within 0.05, smallest payload first
    loose = Chooser(ChooserConfig(), budget=0.06, raw_bytes_per_token=RAW_PER_TOKEN, payload_ratio=RATIO)
    assert loose.allowed(peer()) == ["scd-int8", "reuse", "scd"]


def test_only_local_without_peers_or_allowed_methods():
    c = make().choose(1, N, [])
    assert (c.method, c.reason) == (LOCAL, "only") and "no usable prefill worker" in c.detail
    c = make().choose(1, N, [PeerView(PEER, {"raw": 7.38})])
    assert c.method == LOCAL and "quality budget 0.05" in c.detail


def test_explores_each_unknown_option_once_then_takes_the_fastest():
    chooser, world = make(), World(rate=100e6)
    picks = warmed(world, chooser, requests=6)
    assert [(p.method, p.reason) for p in picks[:3]] == [("scd-int8", "explore"), ("scd", "explore"),
                                                        (LOCAL, "explore")]
    assert all(p.reason == "fastest" for p in picks[3:])
    assert picks[3].predicted_s is not None and picks[3].method in ("scd", "scd-int8") and picks[3].peer == PEER
    assert "ms <" in picks[3].detail  # the ranking that justified it


def test_slow_link_prefers_the_smaller_payload_fast_link_the_cheaper_rebuild():
    chooser, world = make(), World(rate=3e6)  # 24 Mbit/s: the wire dominates
    picks = warmed(world, chooser, requests=8)
    assert {p.method for p in picks[-3:]} == {"scd-int8"}
    chooser, world = make(), World(rate=2e9)  # compute-bound: scd rebuilds faster here
    picks = warmed(world, chooser, requests=8)
    assert {p.method for p in picks[-3:]} == {"scd"}


def test_a_very_slow_link_loses_to_the_local_prefill():
    chooser, world = make(), World(rate=0.5e6)  # 4 Mbit/s: scd-int8's 140 kB take 280 ms, local 61 ms
    picks = warmed(world, chooser, requests=8)
    assert {p.method for p in picks[-3:]} == {LOCAL}


def test_a_prompt_cached_on_this_worker_is_prefilled_here_for_its_uncached_rest():
    chooser, world = make(), World(rate=100e6)  # a transfer beats prefilling all 1024 tokens here
    picks = warmed(world, chooser, requests=6)
    assert picks[-1].method != LOCAL
    cached = chooser.choose(1, N, [peer()], local_cached=N - 64)  # all but 64 tokens in the prefix cache
    assert (cached.method, cached.reason) == (LOCAL, "fastest")
    assert cached.predicted_s == pytest.approx(world.local * 64)  # the speed learnt, times what is left
    # a local prefill's outcome teaches the speed of the tokens it computed
    chooser.observe_outcome(cached, 64, world.local * 64)
    assert chooser.local.value == pytest.approx(world.local)


def test_choice_follows_a_slowed_link_and_a_recovered_one():
    clock = Clock()
    chooser, world = make(clock), World(rate=2e9)
    assert warmed(world, chooser, 8)[-1].method == "scd"
    world.rate = 3e6  # the link slows between two requests
    picks = []
    for _ in range(10):
        clock.now += 0.1
        c = chooser.choose(1, N, [peer()])
        world.serve(chooser, c, 1)
        picks.append(c.method)
    assert picks[-1] == "scd-int8" and picks.index("scd-int8") <= 3, picks
    world.rate = 0.4e6  # slower still: local wins, and while local serves, nothing measures the link
    for _ in range(10):
        clock.now += 0.1
        world.serve(chooser, chooser.choose(1, N, [peer()]), 1)
    assert chooser.choose(1, N, [peer()]).method == LOCAL
    world.rate = 2e9  # it recovers; once the link estimate is stale, one request re-probes it
    clock.now += 31
    c = chooser.choose(1, N, [peer()])
    assert c.reason == "reprobe" and c.peer == PEER and "stale" in c.detail
    world.serve(chooser, c, 1)
    later = [chooser.choose(1, N, [peer()]) for _ in range(1)]
    assert later[0].method != LOCAL


def test_a_compute_bound_transfer_only_says_the_link_is_at_least_that_fast():
    clock = Clock()
    chooser = make(clock)
    common = dict(rebuild_s=0.01, producer_s=0.0, cache_hit=True, wall_s=0.01)
    chooser.observe_transfer(PEER, "scd", 1, N, payload_bytes=280_000, link_bytes=280_000, link_s=0.01,
                             link_bound=True, **common)
    assert chooser.link[PEER].value == pytest.approx(0.01 / 280_000)
    # paced by the rebuild (not link-bound), at a slower pace: the estimate stands
    chooser.observe_transfer(PEER, "scd", 1, N, payload_bytes=280_000, link_bytes=280_000, link_s=0.05,
                             link_bound=False, **common)
    assert chooser.link[PEER].value == pytest.approx(0.01 / 280_000)
    # ... at a faster pace than the estimate: the link is at least that fast
    chooser.observe_transfer(PEER, "scd", 1, N, payload_bytes=280_000, link_bytes=280_000, link_s=0.002,
                             link_bound=False, **common)
    assert chooser.link[PEER].value == pytest.approx(0.002 / 280_000)
    # a cold transfer is paced by the producer: never a link-bound sample
    chooser.observe_transfer(PEER, "scd", 2, N, payload_bytes=280_000, link_bytes=280_000, link_s=0.2,
                             link_bound=True, rebuild_s=0.01, producer_s=0.2, cache_hit=False, wall_s=0.2)
    assert chooser.link[PEER].value == pytest.approx(0.002 / 280_000)
    # too few bytes to say anything about the link
    chooser.observe_transfer(PEER, "scd", 3, 8, payload_bytes=2000, link_bytes=1000, link_s=1.0, link_bound=True,
                             **common)
    assert chooser.link[PEER].value == pytest.approx(0.002 / 280_000)


def test_a_link_that_changed_is_followed_at_once_small_changes_are_smoothed():
    chooser = make(smoothing=0.5)
    common = dict(rebuild_s=0.01, producer_s=0.0, cache_hit=True, wall_s=0.05, link_bound=True)
    sample = lambda s: chooser.observe_transfer(PEER, "scd", 1, N, payload_bytes=100_000,  # noqa: E731
                                                link_bytes=100_000, link_s=s, **common)
    sample(0.010)
    sample(0.012)  # 1.2x: within the noise, smoothed
    assert chooser.link[PEER].value == pytest.approx(0.011 / 100_000)
    sample(0.040)  # ~3.6x: the link changed, followed at once
    assert chooser.link[PEER].value == pytest.approx(0.040 / 100_000)


def test_a_prompt_not_cached_there_pays_the_producer_and_a_busy_producer_more():
    from scd_serve.decode.chooser import Choice

    chooser, world = make(), World(rate=100e6)
    warmed(world, chooser, 8, key=1)  # prompt 1 is cached at the peer
    # a cold request of a fixed method teaches the producer's speed (20 us/token: faster than local here)
    world.serve(chooser, Choice("scd", PEER), key=2, cached=False, producer_s_per_token=20e-6)
    assert chooser.producer[PEER].value == pytest.approx(20e-6)
    warm, cold = chooser.choose(1, N, [peer()]), chooser.choose(3, N, [peer()])
    assert warm.cached and not cold.cached and warm.method != LOCAL != cold.method
    assert cold.predicted_s > warm.predicted_s
    busy = chooser.choose(3, N, [peer(running=3, capacity=4)])  # cold, on a producer shared four ways
    assert busy.method == LOCAL
    assert chooser.choose(1, N, [peer(running=3, capacity=4)]).method != LOCAL  # cached: no producer needed


def test_a_warm_choice_says_whether_to_go_local_should_the_codes_be_gone():
    from scd_serve.decode.chooser import Choice

    chooser, world = make(), World(rate=100e6)
    warmed(world, chooser, 8, key=1)
    world.serve(chooser, Choice("scd", PEER), key=2, cached=False, producer_s_per_token=200e-6)  # a slow producer
    c = chooser.choose(1, N, [peer()])
    assert c.cached and c.local_if_cold  # cold it would take ~200 ms, local ~61 ms
    chooser.observe_cold(PEER, c.method, 1)  # the peer said it holds no codes of that method for prompt 1
    after = chooser.choose(1, N, [peer()])  # nor, then, the other method's (fetched before): cold loses
    assert after.method == LOCAL and not after.cached
    fast, world = make(), World(rate=100e6)
    warmed(world, fast, 8, key=1)
    world.serve(fast, Choice("scd", PEER), key=2, cached=False, producer_s_per_token=20e-6)  # a fast producer
    c = fast.choose(1, N, [peer()])
    assert c.cached and not c.local_if_cold  # cold it still beats local: keep the transfer


def test_a_full_peer_adds_the_wait_for_a_slot():
    chooser, world = make(), World(rate=100e6)
    warmed(world, chooser, 8)
    free = chooser.choose(1, N, [peer(running=0, capacity=2)])
    full = chooser.choose(1, N, [peer(running=4, capacity=2)])
    assert full.method == LOCAL or full.predicted_s > free.predicted_s


def test_a_stale_local_estimate_is_reprobed_only_when_it_could_win():
    clock = Clock()
    chooser, world = make(clock, probe_ratio=3.0), World(rate=2e9, local_s_per_token=60e-6)
    warmed(world, chooser, 8)
    clock.now += 31  # everything stale; the link is refreshed by the transfer it picks
    picks = [chooser.choose(1, N, [peer()])]
    world.serve(chooser, picks[0], 1)
    assert picks[0].reason in ("fastest", "reprobe") and picks[0].method != LOCAL
    # local (61 ms) is > 3x the transfer (~11 ms): not worth re-measuring
    chooser2, world2 = make(clock, probe_ratio=10.0), World(rate=2e9)
    warmed(world2, chooser2, 8)
    clock.now += 31
    assert chooser2.choose(1, N, [peer()]).method == LOCAL  # within 10x: re-probed
    assert chooser2.choose(1, N, [peer()]).method != LOCAL  # once per stale period


def test_outcomes_teach_the_residual_and_the_error_shrinks():
    chooser, world = make(), World(rate=3e6, overhead_s=0.004)
    warmed(world, chooser, 4)
    errors = [world.serve(chooser, chooser.choose(1, N, [peer()]), 1) for _ in range(6)]
    assert all(e is not None for e in errors)
    assert errors[-1] < 0.02 and errors[-1] <= errors[0]
    assert chooser.residual[("scd-int8", True)].value == pytest.approx(0.004, rel=0.05)


def test_fixed_and_failed_requests():
    chooser = make()
    from scd_serve.decode.chooser import Choice

    assert chooser.observe_outcome(Choice("scd"), N, 0.02) is None  # fell back: no transfer measured
    measured = chooser.observe_transfer(PEER, "scd", 1, N, payload_bytes=280_000, rebuild_s=0.01, producer_s=0.0,
                                        cache_hit=True, wall_s=0.01)
    assert measured == (pytest.approx(0.01), True)  # the transfer's core: its rebuild here, on cached codes
    assert chooser.observe_outcome(Choice("scd"), N, 0.02, measured) is None  # measured, but nothing predicted
    assert chooser.residual[("scd", True)].value == pytest.approx(0.01)  # what it learned: the rest of the TTFT
    assert chooser.observe_outcome(Choice(LOCAL), N, 0.06) is None  # no prediction, but it learns
    assert chooser.local.value == pytest.approx(0.06 / N)


def test_codes_reported_gone_take_the_older_ones_at_that_peer_with_them():
    chooser = make()
    for peer_, key in ((PEER, 1), ("other:1", 2), (PEER, 3), (PEER, 4)):
        chooser.observe_transfer(peer_, "scd", key, N, payload_bytes=1, rebuild_s=0.01, producer_s=0.0,
                                 cache_hit=True, wall_s=0.01)
    chooser.observe_cold(PEER, "scd", 3)  # an LRU that evicted 3 evicted 1 before it
    assert list(chooser._cached) == [("other:1", "scd", 2), (PEER, "scd", 4)]


def test_the_cache_guess_is_bounded():
    chooser = make(cache_entries=2)
    for key in range(3):
        chooser.observe_transfer(PEER, "scd", key, N, payload_bytes=1, rebuild_s=0.01, producer_s=0.0,
                                 cache_hit=False, wall_s=0.01)
    assert len(chooser._cached) == 2 and (PEER, "scd", 0) not in chooser._cached
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) != prompt_key([1, 2])
    assert chooser.snapshot()["cached_prompts"] == 2


def test_concurrent_requests_do_not_all_explore_the_same_option():
    chooser = make()
    first, second = chooser.choose(1, N, [peer()]), chooser.choose(1, N, [peer()])
    assert (first.method, second.method) == ("scd-int8", "scd") and first.reason == second.reason == "explore"


@pytest.mark.parametrize("bad, match", [
    ({"quality_budget": -0.1}, "quality_budget"), ({"quality_budget": float("nan")}, "quality_budget"),
    ({"smoothing": 0}, "smoothing"), ({"smoothing": 1.5}, "smoothing"), ({"stale_s": 0}, "stale_s"),
    ({"probe_ratio": 0.5}, "probe_ratio"), ({"cache_entries": -1}, "cache_entries")])
def test_config_is_validated_with_clear_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        ChooserConfig(**bad)


def test_decode_config_holds_the_chooser():
    cfg = DecodeConfig(method="auto", chooser=ChooserConfig(quality_budget=0.05))
    assert cfg.chooser.quality_budget == 0.05 and cfg.method == "auto"


def test_a_measured_top1_is_the_budget_where_the_codebook_has_one():
    """Where calibration measured top-1 agreement on held-out prompts, the floor decides (KL over
    the codebook's KL budget does not exclude a method that agrees often enough); where it did not,
    the KL budget does; an explicitly set KL budget holds beside the floor."""
    agree = PeerView(PEER, {"scd": 0.2, "scd-int8": 0.21, "reuse": 4.8}, top1={"scd": 0.96, "scd-int8": 0.951,
                                                                              "reuse": 0.52})
    floor = Chooser(ChooserConfig(), budget=0.05, raw_bytes_per_token=RAW_PER_TOKEN, payload_ratio=RATIO,
                    min_top1=0.95)
    assert floor.allowed(agree) == ["scd-int8", "scd"]
    strict = Chooser(ChooserConfig(), budget=0.05, raw_bytes_per_token=RAW_PER_TOKEN, payload_ratio=RATIO,
                     min_top1=0.95, strict_kl=True)
    assert strict.allowed(agree) == []
    assert "top-1 >= 0.95 and KL <= 0.05" in strict.choose(1, N, [agree]).detail
    no_top1 = PeerView(PEER, {"scd": 0.04, "reuse": 0.3})
    assert floor.allowed(no_top1) == ["scd"]  # no measured agreement: the KL budget
    higher = Chooser(ChooserConfig(), budget=0.05, raw_bytes_per_token=RAW_PER_TOKEN, payload_ratio=RATIO,
                     min_top1=0.955)
    assert higher.allowed(agree) == ["scd"]


def test_the_manifest_gives_auto_its_top1_figures_and_target(tmp_path):
    import json

    from scd_serve.codec.figures import DEFAULT_MIN_TOP1, QualityFigures

    manifest = {"producer": {"fingerprint": "p"},
                "calibration": {"kl_budget": 0.05, "methods": {"scd": {"kl": 0.2, "top1": 0.96, "payload_ratio": 0.2}}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cal = QualityFigures.load(str(tmp_path))
    assert cal.top1 == {"scd": 0.96} and cal.min_top1 == DEFAULT_MIN_TOP1 and cal.budget == 0.05
    manifest["calibration"]["min_top1"] = 0.9
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert QualityFigures.load(str(tmp_path)).min_top1 == 0.9
    del manifest["calibration"]["methods"]["scd"]["top1"]  # an older codebook: KL only
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert QualityFigures.load(str(tmp_path)).min_top1 is None
