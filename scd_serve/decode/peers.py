"""The prefill workers a decode worker can pull from: handshake, health, load-aware choice.

Peers come from `--prefill` and from the control plane. Each is handshaken (Info) before use
and after any failure; one that differs in a field that matters (does it produce what this
worker can rebuild?) stays unusable, the differing fields named, so /ready and the log say
exactly what to fix. A health loop checks every peer each period, so /ready follows a dead one
within ~2 periods.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from scd_serve.config.methods import AUTO, LOCAL
from scd_serve.config.decode import DecodeConfig
from scd_serve.control.choice import Candidate, LoadBalancer
from scd_serve.control.lifecycle import cancel_all, detach, supervise
from scd_serve.decode.breaker import Breaker
from scd_serve.transport.client import PrefillClient
from scd_serve.transport.proto import PROTOCOL_VERSION

log = logging.getLogger("scd_serve.decode")
MISSES_BEFORE_DOWN = 2


def compat_problems(info, consumer_spec, method: str, codecs, expect_producer: str = "") -> list[str]:
    """[] if compatible; else one 'field: theirs != ours' line per difference."""
    problems = []
    if info.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol_version: {info.protocol_version} != {PROTOCOL_VERSION}")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        theirs, ours = getattr(info, name), getattr(consumer_spec, name)
        if theirs != ours:
            problems.append(f"{name}: producer {theirs} != consumer {ours}")
    if expect_producer and info.producer_fingerprint != expect_producer:
        problems.append(f"producer_fingerprint: {info.producer_fingerprint} != expected {expect_producer}")
    if method in (LOCAL, AUTO) or problems:  # auto: each method is checked when the chooser asks
        return problems
    return problems + method_problems(info, method, codecs)


def method_problems(info, method: str, codecs) -> list[str]:
    """[] if this worker can rebuild `method` from the producer `info` describes."""
    problems = []
    offered = [c for c in info.codecs if c.codec_id == method]
    if not offered:
        return [f"codecs: method {method!r} not offered (offers {sorted({c.codec_id for c in info.codecs})})"]
    if why := codecs.can_build(info, method):
        return [f"codecs: cannot build consumer half of {method!r}: {why}"]
    ours = codecs.get(info, method)
    # a producer that feeds several experts offers a method once per codebook: ours, if it has it
    our_book = getattr(ours, "codebook_id", "") or ""
    theirs = next((c for c in offered if c.codebook_id == our_book), offered[0])
    if theirs.codec_version != ours.version:
        problems.append(f"codec_version[{method}]: {theirs.codec_version} != {ours.version}")
    calibrated_for = getattr(ours, "producer_fingerprint", "") or ""
    if calibrated_for and info.producer_fingerprint != calibrated_for:
        problems.append(f"producer_fingerprint: {info.producer_fingerprint} != {calibrated_for} "
                        f"(the codebook of {method!r} was calibrated for it)")
    if theirs.codebook_id != our_book:
        problems.append(f"codebook_id[{method}]: {theirs.codebook_id or '-'} != {our_book or '-'}")
    return problems


@dataclass
class Peer:
    address: str
    client: object  # PrefillClient (or a test fake)
    static: bool
    info: object | None = None  # pb.InfoReply once the handshake succeeded
    problem: str = "not connected yet"  # "" = usable
    load: dict = field(default_factory=dict)
    missed_checks: int = 0  # consecutive failed health checks
    breaker: Breaker = field(default_factory=Breaker)  # transfers, not health checks: grey failures
    methods: tuple[str, ...] | None = None  # offered methods this worker can rebuild (checked on first need)

    @property
    def usable(self) -> bool:
        return self.info is not None and not self.problem

    def offers(self, method: str) -> bool:
        return self.info is not None and any(c.codec_id == method for c in self.info.codecs)


class PeerSet:
    def __init__(self, runtime, codecs, config: DecodeConfig, client_factory=None):
        self.rt, self.codecs, self.config = runtime, codecs, config
        self.client_factory = client_factory or (lambda addr: PrefillClient(addr, config.transport))
        self.peers: dict[str, Peer] = {}
        self.balancer = LoadBalancer()
        self._task: asyncio.Task | None = None
        self._side_tasks: set[asyncio.Task] = set()  # handshakes of new peers, closes of gone ones
        self.dead = ""  # why the health loop stopped ("" while it runs): the peers' state is then stale
        for address in config.prefill:
            self.add(address, static=True)

    def add(self, address: str, static: bool = False, client=None) -> Peer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = Peer(address, client or self.client_factory(address), static,
                                              breaker=Breaker(self.config.breaker_failures,
                                                              self.config.breaker_cooldown_s))
        return peer

    # ---- handshake and health ------------------------------------------------------------
    async def handshake(self, peer: Peer) -> None:
        try:
            info = await peer.client.info(timeout=self.config.transport.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            peer.info, peer.problem = None, f"unreachable ({exc.code().name})"
            return
        if not await peer.client.connect_streams(self.config.transport.rpc_timeout_s):
            peer.info, peer.problem = None, "unreachable (its Prefill stream channel did not connect)"
            return
        problems = compat_problems(info, self.rt.spec, self.config.method, self.codecs, self.config.expect_producer)
        peer.info, peer.methods = info, None
        if problems and not self.config.allow_incompatible:
            problem = "incompatible: " + "; ".join(problems)
            if problem != peer.problem:
                log.error("prefill %s refused at handshake: %s", peer.address, problem)
            peer.problem = problem
            return
        if problems:
            log.warning("prefill %s differs (%s) but allow_incompatible is set", peer.address, "; ".join(problems))
        if peer.problem:
            log.info("prefill %s connected (producer %s)", peer.address, info.producer_fingerprint)
            peer.breaker.succeeded()  # it was down and is back: the transfers that failed then say nothing now
        peer.problem = ""

    async def check(self, peer: Peer) -> None:
        """One health round for one peer: re-handshake if it was down, else a health check."""
        try:
            if not peer.usable:  # incompatible ones too: the operator may have restarted them fixed
                await self.handshake(peer)
                return
            if await peer.client.serving(timeout=self.config.health_period_s):
                peer.missed_checks = 0
                return
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # we are being stopped
            # grpc.aio raises CancelledError for a call whose channel closed under it (a peer the
            # registry just dropped): that peer failed this check, the health loop goes on
            peer.info, peer.problem = None, "channel closed during a health check"
            return
        peer.missed_checks += 1  # one slow answer on a loaded machine is not a dead peer; two in a row are
        if peer.missed_checks >= MISSES_BEFORE_DOWN:
            peer.problem = "health check failed"
            log.warning("prefill %s stopped answering health checks", peer.address)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(p) for p in list(self.peers.values())))

    def start(self) -> None:
        self._task = supervise(asyncio.create_task(self._health_loop(), name="prefill-health"), self._died)

    def _died(self, exc: BaseException) -> None:
        self.dead = f"prefill health checks stopped: {type(exc).__name__}: {exc}"

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - one bad round must not end health checking for good
                log.exception("prefill health round failed; next round in %.2f s", self.config.health_period_s)
            await asyncio.sleep(self.config.health_period_s)

    # ---- control plane -------------------------------------------------------------------
    def update_from_registry(self, workers: list[dict]) -> None:
        """Apply the registry's peer list: add new prefill workers, drop vanished ones."""
        seen = set()
        for w in workers:
            if w.get("role") != "prefill" or not isinstance(w.get("address"), str):
                continue
            seen.add(w["address"])
            known = w["address"] in self.peers
            peer = self.add(w["address"])
            if not known:  # handshake now rather than at the next health round
                detach(self.check(peer), self._side_tasks)
            peer.load = w.get("load") if isinstance(w.get("load"), dict) else {}
            if not w.get("ready", False) and peer.usable:
                peer.problem = "registry reports not ready"
        for address, peer in list(self.peers.items()):
            if not peer.static and address not in seen:
                del self.peers[address]
                detach(peer.client.close(), self._side_tasks)

    # ---- choice --------------------------------------------------------------------------
    def serving(self, method: str, num_tokens: int) -> list[Peer]:
        """Usable peers, breaker closed (or due a probe), that offer `method` for num_tokens."""
        return [p for p in self.peers.values()
                if p.usable and p.breaker.available() and p.offers(method)
                and num_tokens <= (p.info.max_prompt_tokens or num_tokens)]

    def choose(self, method: str, num_tokens: int, exclude=()) -> Peer | None:
        """Least-loaded serving peer with a free slot (more than max_concurrent: RESOURCE_EXHAUSTED)."""
        cands = [Candidate(p.address, int(p.load.get("running", 0)), int(p.load.get("waiting", 0)),
                           int(p.info.max_concurrent))
                 for p in self.serving(method, num_tokens)
                 if not p.info.max_concurrent or self.balancer.inflight[p.address] < p.info.max_concurrent]
        pick = self.balancer.choose(cands, exclude)
        return None if pick is None else self.peers[pick.address]

    def usable_methods(self, peer: Peer) -> tuple[str, ...]:
        """The methods `peer` offers that this worker can rebuild (checked once per handshake)."""
        if peer.info is None:
            return ()
        if peer.methods is None:
            peer.methods = tuple(c.codec_id for c in peer.info.codecs
                                 if not method_problems(peer.info, c.codec_id, self.codecs))
        return peer.methods

    def ready(self) -> bool:
        return not self.dead and any(p.usable and p.breaker.available() for p in self.peers.values())

    def status(self) -> dict[str, str]:
        """address -> "" (usable) or the problem, for /ready bodies and logs."""
        return {a: p.problem or p.breaker.describe() for a, p in sorted(self.peers.items())}

    def why_not_ready(self) -> str:
        if self.dead:
            return self.dead
        if not self.peers:
            return ("no prefill worker known yet (static --prefill peers or the control plane's "
                    "peer list name them)")
        return "; ".join(f"{a}: {why}" for a, why in self.status().items() if why)

    async def close(self) -> None:
        await cancel_all(*(t for t in (self._task, *self._side_tasks) if t is not None))
        await asyncio.gather(*(p.client.close() for p in self.peers.values()), return_exceptions=True)
