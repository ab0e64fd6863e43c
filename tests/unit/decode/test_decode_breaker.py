"""The per-worker circuit breaker, on a fake clock (no timing)."""

import pytest

from scd_serve.decode.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_opens_after_consecutive_failures_only():
    b = Breaker(failures_to_open=3, cooldown_s=2.0, clock=Clock())
    for _ in range(2):
        b.started()
        b.failed()
    b.started()
    b.succeeded()  # a success in between resets the count
    for _ in range(2):
        b.failed()
    assert b.state == CLOSED and b.available()
    b.failed()
    assert b.state == OPEN and not b.available() and b.num_opened == 1
    assert "circuit open after 3 failed transfers" in b.describe()


def test_one_probe_after_the_cooldown_then_closed_or_open_for_longer():
    clock = Clock()
    b = Breaker(failures_to_open=1, cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    b.failed()
    clock.now += 1.9
    assert not b.available()
    clock.now += 0.1
    assert b.available()
    b.started()  # the probe
    assert b.state == HALF_OPEN and not b.available()  # only one at a time
    b.failed()
    assert b.state == OPEN and b.open_until == pytest.approx(clock.now + 4.0)  # doubled
    clock.now += 4.0
    b.started()
    b.failed()
    assert b.open_until == pytest.approx(clock.now + 5.0)  # capped
    clock.now += 5.0
    b.started()
    b.succeeded()
    assert b.state == CLOSED and b.available() and b.describe() == ""
    b.failed()
    assert b.open_until == pytest.approx(clock.now + 2.0)  # the cool-down starts over


def test_a_probe_without_verdict_lets_the_next_one_go():
    clock = Clock()
    b = Breaker(failures_to_open=1, cooldown_s=1.0, clock=clock)
    b.failed()
    clock.now += 1.0
    b.started()
    assert not b.available()
    b.released()  # the client left, or the worker was merely full
    assert b.available() and b.state == HALF_OPEN


@pytest.mark.parametrize("kwargs", [{"failures_to_open": 0}, {"cooldown_s": 0}, {"cooldown_s": 5, "max_cooldown_s": 1}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Breaker(**kwargs)
