import math

import pytest
import torch
from engine_helpers import probabilities

from scd_serve.engine.detokenizer import Detokenizer
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.sampler import rows_finite, sample
from scd_serve.engine.sequence import Sequence
from scd_serve.testing.fake_runtime import byte_tokenizer
from scd_serve.errors import InvalidRequest, StepFailed


def seqs(*params):
    return [Sequence(GenerationRequest(str(i), [1], p)) for i, p in enumerate(params)]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample(logits, seqs(SamplingParams(temperature=0), SamplingParams(temperature=0))).rows == [1, 0]


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    # float32 logits: the probabilities are exact to float32's rounding (~1e-7)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=p.dtype), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=p.dtype), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))  # always keeps the top token
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-5, 1.0, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("top_p", [5e-324, 1e-138, 1e-8, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [-1, 1, 3, 2**63 - 1])
def test_every_legal_extreme_gives_a_distribution(temperature, top_p, top_k):
    """The one-request denial of service: top_p 1e-138 rounded to 0 in float32 and every token
    was dropped (NaN); a tiny temperature made inf - inf. Any legal value must sample."""
    logits = torch.randn(200, generator=torch.Generator().manual_seed(3)) * 8
    logits[5] = logits[17] = logits.max() + 1  # a tie for the best token
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=2**63 - 1)
    p = probabilities(logits, params)
    assert torch.isfinite(p).all() and (p >= 0).all() and abs(float(p.sum()) - 1) < 1e-9
    (token,) = sample(logits[None], seqs(params)).rows
    assert isinstance(token, int) and 0 <= token < 200
    # all the mass on the best tokens (a huge temperature makes every token equally likely: then
    # a tiny top_p keeps one of those, any)
    if temperature < 1e-5 or top_k == 1 or (top_p < 1e-8 and temperature <= 1.0):
        assert token in (5, 17)


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-30, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("temperature", [0, 1e-300, 1.0])
def test_an_extreme_repetition_penalty_still_samples(penalty, temperature):
    """Found by the schema fuzzer: a tiny penalty divided positive logits to +inf, a huge one
    multiplied negative ones to -inf, and inf - inf made the probabilities NaN (a 500)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4)) * 8
    seen = list(range(50))  # every token in the prompt: all are penalised
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=7)
    (token,) = sample(logits[None], [Sequence(GenerationRequest("r", seen, params))]).rows
    assert isinstance(token, int) and 0 <= token < 50


def test_rows_finite_is_exact_even_where_a_finite_rows_sum_overflows():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[0.0, 1.0, 2.0], [big, big, 0.0], [float("-inf"), 0.0, 0.0], [float("nan"), 1.0, 1.0],
                      [float("inf"), float("-inf"), 0.0]])
    assert rows_finite(x) == [True, True, False, False, False] == torch.isfinite(x).all(dim=-1).tolist()


def test_non_finite_row_fails_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 1.0], [0.0, float("inf"), 1.0]])
    out = sample(logits, seqs(SamplingParams(temperature=0), SamplingParams(temperature=0.5),
                              SamplingParams(temperature=0))).rows
    assert out[0] == 1 and all(isinstance(e, StepFailed) and "non-finite" in e.message for e in out[1:])


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_logits, n=20):
        (s,) = seqs(p)
        return [sample(batch_logits, [s]).rows[0] for _ in range(n)]

    alone = draw(logits[:1])
    again = draw(logits[:1])
    assert alone == again
    # the same sequence next to two others draws the same tokens
    s, o1, o2 = seqs(p, SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0))
    together = [sample(logits, [s, o1, o2]).rows[0] for _ in range(20)]
    assert together == alone
    (s,) = seqs(SamplingParams(temperature=1.0, seed=43))
    assert [sample(logits[:1], [s]).rows[0] for _ in range(20)] != alone


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": -1}), ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}), ("top_p", {"top_p": 0}), ("top_p", {"top_p": 1.1}),
    ("top_p", {"top_p": -0.1}), ("top_k", {"top_k": 0}), ("top_k", {"top_k": -2}),
    ("max_tokens", {"max_tokens": 0}), ("seed", {"seed": -1}), ("seed", {"seed": 2**63}),
    ("stop", {"stop": ("",)}),
])
def test_sampling_params_reject_out_of_range_naming_the_field(field, kwargs):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in e.value.message


def test_valid_extremes_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, seed=0, max_tokens=1)
    SamplingParams(seed=2**63 - 1, top_k=1)


def feed(detok, text, tok):
    return [detok.add(t) for t in tok.encode(text)]


def test_detokenizer_holds_partial_utf8_and_reassembles():
    tok = byte_tokenizer()
    d = Detokenizer(tok, [])
    deltas = feed(d, "aé😀b", tok)
    assert "".join(deltas) == "aé😀b"
    assert "\ufffd" not in "".join(deltas)
    assert deltas[1] == ""  # first byte of é alone is not emitted


def test_detokenizer_stop_sequence_cuts_and_never_leaks_a_prefix():
    tok = byte_tokenizer()
    d = Detokenizer(tok, [], stop=("STOP",))
    deltas = feed(d, "hello STOP world", tok)
    assert d.stopped and d.text == "hello "
    assert "".join(deltas) == "hello "
    assert all("S" not in x for x in deltas)
    d = Detokenizer(tok, [], stop=("xyz",))
    assert "".join(feed(d, "abcxy", tok)) + d.flush() == "abcxy"  # held-back tail flushed at the end


def test_a_batch_of_rows_samples_each_rows_own_distribution():
    """Batched sampling (one exponential race over the batch) draws token i with probability
    p_i in every row, with each row's own temperature and cut: 3,000 rows, frequencies within
    5 standard errors."""
    n = 3000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(n, 1)
    params = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams(temperature=1.0, top_k=2, seed=i)
              for i in range(n)]
    out = torch.tensor(sample(logits, seqs(*params)).rows)
    for rows, want in ((out[1::2], [0.5, 0.3, 0.15, 0.05]), (out[0::2], [0.625, 0.375, 0.0, 0.0])):
        freq = torch.bincount(rows, minlength=4).double() / rows.numel()
        for f, p in zip(freq.tolist(), want):
            assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / rows.numel()) + (0 if p else 1e-12)


def test_a_sampling_bug_costs_only_the_row_it_hits(monkeypatch):
    """The batched draw fails; row by row, only the request whose own draw fails gets StepFailed,
    and greedy rows and the other sampled rows keep their tokens."""
    import scd_serve.engine.sampler as sampler

    real = sampler.candidates

    def broken(logits, params):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("injected")
        return real(logits, params)

    monkeypatch.setattr(sampler, "candidates", broken)
    logits = torch.tensor([[0.0, 9.0, 1.0]] * 3)
    out = sample(logits, seqs(SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=13),
                              SamplingParams(temperature=1e-3, seed=1))).rows
    assert out[0] == 1 and out[2] == 1
    assert isinstance(out[1], StepFailed) and "injected" in out[1].message
