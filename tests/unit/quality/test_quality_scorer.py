"""`eval --data` metrics on cases with known answers: hand-made distributions, and the oracle
against itself through a real tiny model."""

import math

import pytest
import torch

from scd_serve import codec
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.quality.data import Prompt, Prompts, Record, tokenize
from scd_serve.quality.scorer import OracleRun, Run, Scorer, Tally, answer_text, score
from scd_serve.quality.transfer import MISMATCHED, donor_prefix


def logits_of(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def test_score_on_hand_made_distributions():
    # oracle: [0.9, 0.1] at both positions; the method moves position 0 to [0.3, 0.7]
    oracle = OracleRun(logits_of([0.9, 0.1], [0.9, 0.1]), [0, 0, 1], 0, 1.0, scored=torch.tensor([0, 0]))
    method = Run(logits_of([0.3, 0.7], [0.9, 0.1]), [1, 0, 1], 10, 0.5)
    p = Prompt(torch.tensor([5, 6]), torch.tensor([0, 0]), None, "text", "f:1")
    s = score(method, oracle, p, greedy_tokens=2)
    assert s["positions"] == 2
    assert s["kl"] == pytest.approx(0.3 * math.log(0.3 / 0.9) + 0.7 * math.log(0.7 / 0.1))
    assert s["tv"] == pytest.approx(0.6)
    assert s["top1"] == 1.0  # position 0 disagrees, position 1 agrees
    assert s["nll"] == pytest.approx(-math.log(0.3) - math.log(0.9)) and s["nll_tokens"] == 2
    assert s["match"] == 0.0  # first greedy token differs
    # the oracle against itself, and the oracle's logits shifted by a constant per row: same distributions
    same = score(oracle, oracle, p, 2)
    assert same["kl"] == 0.0 and same["tv"] == 0.0 and same["top1"] == 2.0 and same["match"] == 1.0
    shifted = Run(oracle.logits + torch.tensor([[3.0], [-2.0]], dtype=torch.float64), [0, 0, 1], 0, 0.0)
    s = score(shifted, oracle, p, 2)
    assert s["kl"] == pytest.approx(0.0, abs=1e-12) and s["top1"] == 2.0 and s["match"] == 1.0
    # chunks of one row give the same sums
    assert score(method, oracle, p, 2, chunk=1) == pytest.approx(score(method, oracle, p, 2))


def test_tally_divides_by_the_right_counts():
    p_text = Prompt(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), None, "text", "f:1")
    p_qa = Prompt(torch.tensor([1, 2]), torch.tensor([7]), "a", "prompt", "f:2")
    prompts = Prompts("f", [p_text, p_qa], 100, 1, 0)
    t = Tally("raw")
    t.add({"kl": 0.3, "tv": 0.3, "top1": 2, "positions": 2, "match": 1, "nll": 2.0, "nll_tokens": 2,
           "bytes": 200, "rebuild": 1.0, "prefill": 4.0})
    t.add({"kl": 0.0, "tv": 0.0, "top1": 0, "positions": 1, "match": 0, "nll": 1.0, "nll_tokens": 1,
           "bytes": 100, "rebuild": 1.0, "prefill": 4.0, "f1": 0.5, "em": 0.0})
    row = t.row(prompts, 4)
    assert row["kl"] == pytest.approx(0.1) and row["top1"] == pytest.approx(2 / 3) and row["match"] == 0.5
    assert row["ppl"] == pytest.approx(math.e) and row["f1"] == 0.5 and row["num_answers"] == 1
    assert row["payload_bytes_per_token"] == pytest.approx(300 / 3)  # 2 + 1 transferred tokens
    assert row["rebuild_vs_prefill"] == 0.25 and row["num_truncated"] == 1


def test_answer_text_stops_at_eos():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    assert answer_text(Tok(), [4, 5, 9, 6], 3, stop=9) == "4 5"
    assert answer_text(Tok(), [4, 5, 6, 7], 3, stop=9) == "4 5 6"


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("m") / "m", "qwen2", seed=3))


def test_oracle_against_itself_and_identity_on_one_model(rt):
    records = [Record("f:1", "text", "the cat sat on the mat"), Record("f:2", "prompt", "abc def", "gh"),
               Record("f:3", "prompt", "hello wor")]
    prompts = tokenize(records, rt.tokenizer, 64, "f")
    ident = codec.build("identity", producer=rt, consumer=rt)
    oracle, same = Scorer(rt, rt, prompts, greedy_tokens=5, show_progress=False).evaluate(
        {"oracle": None, "identity": ident})
    assert oracle["kl"] == 0.0 and oracle["tv"] == 0.0 and oracle["top1"] == 1.0 and oracle["match"] == 1.0
    assert same["kl"] == 0.0 and same["top1"] == 1.0 and same["match"] == 1.0
    assert same["ppl"] == oracle["ppl"] and same["f1"] == oracle["f1"] and same["em"] == oracle["em"]
    assert oracle["num_answers"] == 1 and oracle["payload_bytes_per_token"] == 0
    # scored: the text's second half, the answer, and the oracle's 5 greedy tokens (fewer at EOS)
    given = len(prompts.items[0].reference) + len(prompts.items[1].reference)  # 11 bytes + 2
    assert given + 1 <= oracle["scored_positions"] <= given + 5
    assert same["payload_bytes_per_token"] > 0


def test_the_oracles_perplexity_is_the_models_own_over_the_second_half(rt, tmp_path):
    """The scorer's oracle PPL equals transformers' own forward over the whole text, scored on the
    same positions: a rebuilt cache that scores below it does so for real, not by the scorer."""
    import transformers

    records = [Record("f:1", "text", "the quick brown fox jumps over the lazy dog again and again"),
               Record("f:2", "text", "pack my box with five dozen liquor jugs, said the sphinx")]
    prompts = tokenize(records, rt.tokenizer, 64, "f")
    (oracle,) = Scorer(rt, rt, prompts, greedy_tokens=3, show_progress=False).evaluate({"oracle": None})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(rt.path), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for p in prompts.items:
        full = torch.cat([p.ids, p.reference])
        with torch.no_grad():
            logp = torch.log_softmax(hf(full[None]).logits[0].double(), -1)
        first = p.ids.numel()  # position first - 1 predicts the first scored token
        nll -= float(logp[first - 1: full.numel() - 1].gather(1, full[first:, None]).sum())
        count += p.reference.numel()
    assert oracle["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_donor_prefix_is_other_prompts_text_of_the_same_length():
    prompts = [torch.arange(0, 5), torch.arange(10, 13), torch.arange(20, 24)]
    d = donor_prefix(prompts, 0, 5)
    assert d.tolist() == [10, 11, 12, 20, 21]  # the prompts after 0, never 0's own
    assert donor_prefix(prompts, 2, 9).tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 0]  # cyclic, repeated when short
    with pytest.raises(ValueError, match="two prompts"):
        donor_prefix(prompts[:1], 0, 3)


def test_mismatched_codes_control_rebuilds_from_another_prompts_codes(rt):
    """Through an exact codec on one model the prompt's own codes give the oracle, another
    prompt's codes do not: the control measures whether codes carry the prompt."""
    records = [Record("f:1", "text", "the cat sat on the mat and looked at the rain outside"),
               Record("f:2", "text", "numbers: one two three four five six seven eight nine"),
               Record("f:3", "text", "a b c d e f g h i j k l m n o p q r s t u v w x y z")]
    prompts = tokenize(records, rt.tokenizer, 64, "f")
    ident = codec.build("identity", producer=rt, consumer=rt)
    _, own, mismatched = Scorer(rt, rt, prompts, greedy_tokens=3, show_progress=False).evaluate(
        {"oracle": None, "identity": ident, MISMATCHED: ident})
    assert own["kl"] == 0.0
    assert mismatched["kl"] > 0.05 and mismatched["top1"] < 1.0
    assert mismatched["payload_bytes_per_token"] == own["payload_bytes_per_token"]
