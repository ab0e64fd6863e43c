"""The registry's ZMQ endpoint: a ROUTER that takes heartbeats and answers with the peer list.

With a cluster secret it is a CURVE server (curve.py): a peer is authenticated in the handshake,
before any message of it is read; one without the secret is refused there and counted
(`handshake_failed`: another cluster secret, or plain ZMTP; `unauthenticated`: the registry's key
but another client key, refused by ZAP). MAXMSGSIZE bounds
every frame and the receive high-water mark the messages queued per connection. Every message
is checked before it touches the table (`registry.validate`); one that fails is dropped and
counted by reason (scd_control_dropped_messages_total), and no frame can end the serving task.
A worker id stays bound to the address it first advertised until it says bye or expires. A
decode worker counts as ready only after the registry reached it (GET http://ADDRESS/live
answered 200); prefill workers are handshaken by each decode worker over gRPC Info.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import zmq
import zmq.asyncio

from scd_serve.config.control import ControlConfig
from scd_serve.control.curve import Gatekeeper, keys_from, serve_curve
from scd_serve.control.lifecycle import Restarting, cancel_all
from scd_serve.control.registry import Registry, Rejected, WorkerRecord, decode_json, encode, validate

log = logging.getLogger("scd_serve.control")
LOG_EVERY_S = 10.0  # a flood of bad frames logs one line per reason this often, with the count
VERIFY_ROLES = ("decode",)
RCVHWM = 64  # messages queued per worker connection; a worker sends one per heartbeat period
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


async def probe_http_live(address: str, timeout_s: float) -> bool:
    """The handshake for a decode worker: its HTTP listener at `address` answers /live."""
    import httpx

    try:  # trust_env=False: a proxy from the environment must not answer in the worker's place
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            r = await client.get(f"http://{address}/live")
        return r.status_code == 200 and r.json().get("status") == "ok"
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


class RegistryServer:
    def __init__(self, bind_url: str, config: ControlConfig, registry: Registry | None = None,
                 probe=probe_http_live, verify_roles: tuple[str, ...] = VERIFY_ROLES):
        self.config = config
        self.registry = registry or Registry(config.worker_ttl_s, max_workers=config.max_workers,
                                             verify_roles=verify_roles)
        self.probe = probe
        self.dropped: Counter[str] = Counter()  # reason -> frames dropped
        # its own context: the ZAP handler is one per context, and each registry admits its own key
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # frames over the cap (handshake commands included) close the sender's connection unread
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.SNDHWM, RCVHWM)
        self.gatekeeper = None
        if config.secret:
            keys = keys_from(config.secret)
            serve_curve(self.sock, keys)
            self.gatekeeper = Gatekeeper(self.ctx, keys, lambda: self._drop(
                "unauthenticated", "a CURVE client with another key (a different cluster secret?)"))
            self.gatekeeper.start()
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.sock.bind(bind_url)
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # real port when bound to :0
        # serves until close(); a task that dies anyway is logged and started again (else workers
        # would never expire and the gateway would route to the dead)
        self.runner = Restarting(lambda: self._serve(), "control-registry")
        self.num_handshake_failures = 0
        self._probes: dict[str, asyncio.Task] = {}
        self._next_probe: dict[str, float] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last log time, count then)

    @property
    def alive(self) -> bool:
        return self.runner.alive

    def start(self) -> None:
        self.runner.start()

    async def _serve(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            try:
                ready = dict(await poller.poll(timeout=int(self.config.heartbeat_s * 1000)))
                if self.monitor in ready:
                    await self.monitor.recv_multipart()
                    self._drop("handshake_failed", "a peer failed the CURVE handshake (another cluster "
                                                   "secret, or none)")
                if self.registry.clock() - self.registry.expired_at >= self.config.heartbeat_s:
                    self.registry.expire()  # also while heartbeats keep coming
                if self.sock not in ready:
                    continue
                frames = await self.sock.recv_multipart()
            except zmq.ZMQError as exc:
                self._drop("transport", f"receive failed: {exc}")
                await asyncio.sleep(0.1)
                continue
            try:
                reply = self.handle(frames)
                if reply is not None:
                    await self.sock.send_multipart([frames[0], reply])
            except Rejected as exc:
                self._drop(exc.reason, str(exc))
            except Exception as exc:  # noqa: BLE001 - one frame must never end the registry
                self._drop("internal", f"{type(exc).__name__}: {str(exc)[:200]}", exc)

    def handle(self, frames: list[bytes]) -> bytes | None:
        """Apply one received message; the reply to send back, or None. Rejected when dropped."""
        if len(frames) != 2:
            raise Rejected("malformed", f"{len(frames) - 1} frames, expected 1")
        raw = frames[1]
        if len(raw) > self.config.max_message_bytes:
            raise Rejected("malformed", f"message of {len(raw)} bytes exceeds {self.config.max_message_bytes}")
        msg = validate(decode_json(raw))
        if msg["type"] == "bye":
            self.registry.apply(msg)
            return None
        rec = self.registry.get(msg["id"])
        if rec is not None and (rec.address, rec.role) != (msg["address"], msg["role"]):
            raise Rejected("id_conflict", f"worker {msg['id'][:64]} is registered at another address")
        self.registry.apply(msg)
        if rec is None:
            log.info("control: %s worker %s joined at %s", msg["role"], msg["id"], msg["address"])
        self._maybe_verify(self.registry.get(msg["id"]))
        return encode(self.registry.peers_message())

    def _drop(self, reason: str, why: str, exc: BaseException | None = None) -> None:
        self.dropped[reason] += 1
        now = time.monotonic()
        last, count = self._logged.get(reason, (-LOG_EVERY_S, 0))
        if now - last >= LOG_EVERY_S:
            since = self.dropped[reason] - count
            log.warning("control: dropped a message (%s: %s)%s", reason, why[:200],
                        f"; {since} dropped for this reason since the last report" if since > 1 else "",
                        exc_info=exc)
            self._logged[reason] = (now, self.dropped[reason])

    # ---- address handshake ---------------------------------------------------------------

    def _maybe_verify(self, rec: WorkerRecord | None) -> None:
        if rec is None or rec.verified or rec.id in self._probes:
            return
        now = time.monotonic()
        if now < self._next_probe.get(rec.id, 0.0):
            return
        if len(self._next_probe) > 2 * self.config.max_workers:  # forget workers that are gone
            self._next_probe = {w: t for w, t in self._next_probe.items() if self.registry.get(w) is not None}
        self._probes[rec.id] = asyncio.create_task(self._verify(rec.id, rec.address), name=f"verify-{rec.id[:32]}")

    async def _verify(self, wid: str, address: str) -> None:
        timeout = self.config.verify_timeout_s
        try:
            ok = await asyncio.wait_for(self.probe(address, timeout), timeout + 1.0)
        except Exception:  # noqa: BLE001 - a failed probe is a failed handshake, nothing more
            ok = False
        finally:
            self._probes.pop(wid, None)
        rec = self.registry.get(wid)
        if rec is None or rec.address != address:
            return  # gone (bye, expired) while the handshake ran
        if ok and self.registry.mark_verified(wid, address):
            self._next_probe.pop(wid, None)
            log.info("control: worker %s answered at %s; routing to it", wid, address)
            return
        self.num_handshake_failures += 1
        first = wid not in self._next_probe
        self._next_probe[wid] = time.monotonic() + max(1.0, 2 * self.config.heartbeat_s)
        if first:
            log.warning("control: worker %s advertises %s, which did not answer the handshake; not routing "
                        "to it (retrying)", wid, address)

    async def close(self) -> None:
        await self.runner.stop()
        await cancel_all(*self._probes.values())
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.destroy(linger=0)  # whatever socket is left: never a term() that waits


class DroppedCollector:
    """Prometheus collector: scd_control_dropped_messages_total{reason} of a RegistryServer."""

    def __init__(self, server: RegistryServer):
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("scd_control_dropped_messages", "control-plane frames dropped, by reason",
                                     labels=["reason"])
        for reason, n in sorted(self.server.dropped.items()):
            family.add_metric([reason], n)
        yield family
        yield CounterMetricFamily("scd_control_handshake_failures", "worker addresses that did not answer the "
                                  "registry's handshake", value=self.server.num_handshake_failures)
