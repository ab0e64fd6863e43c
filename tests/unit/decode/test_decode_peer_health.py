"""The prefill health loop is supervised: a failing round or a channel closed under a pending
check does not end it; a death is logged and makes the peers not ready."""

import asyncio
import logging

import grpc
from polls import eventually

from scd_serve.config.decode import DecodeConfig
from scd_serve.control.lifecycle import supervise
from scd_serve.decode.peers import PeerSet
from scd_serve.transport.status import rpc_error


class Client:
    """A prefill client whose health check misbehaves as told."""

    def __init__(self, behaviours):
        self.behaviours = list(behaviours)
        self.checks = 0

    async def serving(self, timeout=None):
        self.checks += 1
        what = self.behaviours.pop(0) if self.behaviours else "ok"
        if what == "closed":
            raise asyncio.CancelledError()  # what grpc.aio raises when the channel closes under the call
        if what == "bug":
            raise RuntimeError("a bug in one round")
        return True

    async def info(self, timeout=None):  # the re-handshake of a peer marked down: still down
        self.checks += 1
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "down")

    async def close(self):
        pass


def usable_peers(client) -> PeerSet:
    peers = PeerSet(None, None, DecodeConfig(model="unused", prefill=("127.0.0.1:1",), health_period_s=0.05),
                    client_factory=lambda address: client)
    (peer,) = peers.peers.values()
    peer.info, peer.problem = object(), ""  # as after a handshake
    return peers


async def test_a_check_whose_channel_closes_is_a_failed_check_not_a_dead_loop():
    client = Client(["closed"])
    peers = usable_peers(client)
    (peer,) = peers.peers.values()
    await peers.check(peer)  # before: CancelledError escaped and ended the health loop
    assert not peer.usable and "channel closed" in peer.problem


async def test_the_health_loop_outlives_a_failing_round():
    client = Client(["bug", "closed"])
    peers = usable_peers(client)
    peers.start()
    try:
        assert await eventually(lambda: client.checks >= 4, timeout=10), client.checks
        assert not peers.dead and peers._task is not None and not peers._task.done()
    finally:
        await peers.close()


async def test_a_dead_background_task_is_logged_and_reported(caplog):
    died = []

    async def doomed():
        await asyncio.sleep(0)
        raise KeyError("state that should not be missing")

    with caplog.at_level(logging.ERROR):
        task = supervise(asyncio.create_task(doomed(), name="doomed"), died.append)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done-callbacks run on the next turn of the loop
    assert len(died) == 1 and isinstance(died[0], KeyError)
    assert "background task doomed died" in caplog.text and "Traceback" in caplog.text


async def test_peers_whose_health_loop_died_are_not_ready():
    peers = usable_peers(Client([]))
    assert peers.ready()
    peers._died(RuntimeError("gone"))
    assert not peers.ready() and "health checks stopped" in peers.why_not_ready()


async def test_stopping_the_loop_still_cancels_it():
    client = Client([])
    peers = usable_peers(client)
    peers.start()
    assert await eventually(lambda: client.checks >= 1, timeout=10)
    await peers.close()
    assert peers._task.cancelled()
