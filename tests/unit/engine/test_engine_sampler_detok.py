import math

import pytest
import torch

from scd_serve.engine.detokenizer import Detokenizer
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.sampler import probabilities, sample
from scd_serve.engine.sequence import Sequence
from scd_serve.engine.toy import byte_tokenizer
from scd_serve.errors import InvalidRequest


def seqs(*params):
    return [Sequence(GenerationRequest(str(i), [1], p)) for i, p in enumerate(params)]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample(logits, seqs(SamplingParams(temperature=0), SamplingParams(temperature=0))) == [1, 0]


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))  # always keeps the top token
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_logits, n=20):
        (s,) = seqs(p)
        return [sample(batch_logits, [s])[0] for _ in range(n)]

    alone = draw(logits[:1])
    again = draw(logits[:1])
    assert alone == again
    # the same sequence next to two others draws the same tokens
    s, o1, o2 = seqs(p, SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0))
    together = [sample(logits, [s, o1, o2])[0] for _ in range(20)]
    assert together == alone
    (s,) = seqs(SamplingParams(temperature=1.0, seed=43))
    assert [sample(logits[:1], [s])[0] for _ in range(20)] != alone


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
