"""Transfer: one request's transfer facts in one object (no request-id maps), and the handoff rule."""

from scd_serve.config.methods import LOCAL
from scd_serve.decode.chooser import Choice
from scd_serve.decode.transfer import Transfer, handoff


def test_the_handoff_is_every_prompt_token_but_the_last():
    assert handoff([5, 6, 7]) == [5, 6] and handoff((9,)) == [] and handoff([]) == []


def test_the_preferred_worker_is_taken_once():
    t = Transfer(Choice("scd", peer="a:1", reason="fastest"), peer="a:1")
    assert t.take_peer() == "a:1" and t.take_peer() == ""  # a retry lets the load-aware choice decide


def test_what_the_response_reports():
    chosen = Choice("scd", peer="a:1", reason="fastest")
    t = Transfer(chosen)
    assert t.reported(fallback_to_local=True) is chosen
    t.failed = "transfer_failed"
    fell_back = t.reported(fallback_to_local=True)
    assert (fell_back.method, fell_back.reason) == (LOCAL, "fallback") and "scd@a:1 failed (transfer_failed)" in \
        fell_back.detail
    assert t.reported(fallback_to_local=False) is chosen  # the request failed: it was not prefilled here
    cold = Transfer(chosen, switched=Choice(LOCAL, reason="cold-switch"))
    assert cold.reported(True).reason == "cold-switch"
    assert Transfer(Choice(LOCAL), failed="x").reported(True).method == LOCAL
