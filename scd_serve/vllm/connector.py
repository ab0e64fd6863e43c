"""SCDConnector: vLLM's KV connector (KVConnectorBase_V1) that fills a vLLM consumer's paged
cache from scd-serve prefill workers' codes, so a vLLM engine decodes a prompt another model
(the producer) prefilled.

    vllm serve CONSUMER --kv-transfer-config '{"kv_connector": "SCDConnector",
        "kv_connector_module_path": "scd_serve.vllm.connector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"prefill": ["HOST:PORT"], "method": "scd", "codebook": "DIR"}}'

Scheduler side (plain bookkeeping): a prompt of at least min_prompt_tokens claims the K/V of
its handed-off tokens past vLLM's own prefix-cache hit, less the codebook's replayed tail, which
vLLM computes itself with the last token (as scd-serve's engine does). The load is asynchronous:
the request waits (WAITING_FOR_REMOTE_KVS) while vLLM keeps decoding the others. Worker side:
each claimed prompt's codes are fetched and rebuilt in a load thread (source.py) and written
into its blocks, layer by layer as they arrive, through the attention backend's own cache update,
so any backend's cache layout (and an fp8 cache) is written as vLLM writes it. A load that fails
reports its blocks; vLLM's kv_load_failure_policy "recompute" then prefills them itself: a
half-filled cache is never decoded from. A request may opt out with
`kv_transfer_params: {"scd": false}`. The producer role is an scd-serve prefill worker, its
prefill computed by scd-serve's engine or by vLLM's (`--engine vllm`, producer.py).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from scd_serve.codec import NEEDS_CONSUMER_WEIGHTS, replayed
from scd_serve.codec.base import carried
from scd_serve.codec.codebook import MANIFEST, Codebook
from scd_serve.config.connector import ConnectorConfig
from scd_serve.engine.kv_budget import RAW_DTYPE_BYTES, bytes_per_token
from scd_serve.errors import ConfigError
from scd_serve.model.runtime import ModelRuntime
from scd_serve.vllm.source import CodeSource
from scd_serve.vllm.stats import SCDConnectorStats

log = init_logger("vllm.scd_serve")  # under vLLM's logger: its handlers and format
LOAD_THREADS = 8  # prompts loaded at once; more wait for a thread (within their deadline)
IDLE_WAIT_S = 0.05  # the longest an empty step waits for a load to finish


@dataclass
class Load:
    request_id: str
    tokens: list[int]  # the prompt's first start + n tokens: the K/V to fill is of positions start..
    start: int  # rows before it are vLLM's own (its prefix cache)
    block_ids: list[int]  # the request's blocks, from its first


@dataclass
class SCDConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class SCDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        if tc.kv_role != "kv_consumer":
            raise ConfigError(f"SCDConnector serves kv_role 'kv_consumer' (got {tc.kv_role!r}): the producer "
                              f"side is an scd-serve prefill worker (`scd-serve prefill --model PRODUCER`, with "
                              f"`--engine vllm` for vLLM to compute its prefill)")
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        parallel = getattr(vllm_config, "parallel_config", None)
        tp, pp = (getattr(parallel, f"{kind}_parallel_size", 1) for kind in ("tensor", "pipeline"))
        if tp > 1 or pp > 1:  # each worker would hold a slice of the heads or layers the codes rebuild whole
            raise ConfigError(f"SCDConnector fills a single-worker vLLM engine; this one has tensor_parallel_size "
                              f"{tp}, pipeline_parallel_size {pp}")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:  # one block table per group: the writes below know the first only
            raise ConfigError(f"SCDConnector fills models with one KV cache group; this one has {len(groups)} "
                              f"(sliding-window or hybrid layers)")
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            book = Codebook(json.loads((Path(self.config.codebook) / MANIFEST).read_text()), {}) \
                if self.config.codebook else None
            self.replay = replayed(self.config.method, book)
            self._local: dict[str, int] = {}  # request -> vLLM's own computed tokens when it last claimed
            self._pending: dict[str, Load] = {}  # claimed and allocated, not yet in a step's metadata
            self._claimed: set[str] = set()  # requests that had their one transfer (until they finish)
        else:
            model = vllm_config.model_config
            device = str(vllm_config.device_config.device)
            self.dtype = model.dtype
            # the consumer's own weights, for what a rebuild computes (token prior, Patch, runs): a
            # second copy beside vLLM's; a method that computes nothing loads its shapes alone
            runtime = ModelRuntime.load(model.model, device=device, dtype=model.dtype,
                                        weights=self.config.method in NEEDS_CONSUMER_WEIGHTS)
            self.source = CodeSource(self.config, runtime)
            self.source.codecs.loaded_codebook()  # a codebook of other models is refused now, not per request
            said = self.source.codecs.fill_prior_table(self.config.prior_table, self.config.prior_table_budget_s)
            if said:
                log.info("SCD token prior: %s", said)
            self._caches: dict[str, torch.Tensor] = {}
            self._layer_names: dict[int, str] = {}
            self._threads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="scd-load")
            self._failed_blocks: set[int] = set()
            self._loading: dict[str, tuple[Load, Future, threading.Event]] = {}  # request -> its load, its cancel
            self._stats = SCDConnectorStats()
            spec = runtime.spec  # what 16-bit raw K/V of one row costs, the codes' yardstick
            self._raw_row_bytes = bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, RAW_DTYPE_BYTES)

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids or []
        params = request.kv_transfer_params or {}
        if len(prompt) < self.config.min_prompt_tokens or params.get("scd") is False:
            return 0, False
        if request.request_id in self._claimed:  # asked again after a failed load (or a preemption):
            return 0, False  # vLLM computes it itself, no second transfer
        # every prompt token but the last (it gives the first logits), less the replayed tail
        claim = carried(len(prompt) - 1, self.replay)
        if claim <= num_computed_tokens:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        return claim - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        start = self._local.pop(request.request_id, None)
        if num_external_tokens <= 0 or start is None:
            return
        tokens = list(request.prompt_token_ids[:start + num_external_tokens])
        self._claimed.add(request.request_id)  # committed now (a claim that found no free blocks is asked again)
        self._pending[request.request_id] = Load(request.request_id, tokens, start, list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output) -> SCDConnectorMetadata:
        meta = SCDConnectorMetadata(list(self._pending.values()))  # loads start in this step's worker pass
        self._pending.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._local.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._claimed.discard(request.request_id)
        return False, None

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)
        self._layer_names = {extract_layer_index(name): name for name in kv_caches}
        layers = self.source.rt.spec.num_layers
        if sorted(self._layer_names) != list(range(layers)):
            raise ConfigError(f"vLLM's KV caches are of layers {sorted(self._layer_names)}; the consumer "
                              f"{self.source.rt.path} has {layers}")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SCDConnectorMetadata):
            return
        for load in meta.loads:  # asynchronous: get_finished reports each when it is done
            cancel = threading.Event()
            job = self._threads.submit(self._load, load, forward_context.no_compile_layers, cancel)
            self._loading[load.request_id] = (load, job, cancel)
        if forward_context.attn_metadata is None and self._loading:
            # A step with nothing to run while loads are in flight: vLLM's loop would come straight
            # back, holding the GIL and a core the load threads need. Wait for one to finish instead
            # (at most IDLE_WAIT_S), which hands both to them.
            wait([job for _, job, _ in self._loading.values()], IDLE_WAIT_S, FIRST_COMPLETED)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The loads done since the last call, failed ones included: their blocks are reported
        (get_block_ids_with_load_errors, called after this in the same pass) and recomputed."""
        done = set()
        for rid in finished_req_ids & self._loading.keys():  # ended (aborted) while loading: stop it
            self._loading[rid][2].set()
        for rid, (load, job, cancel) in list(self._loading.items()):
            if not job.done():
                continue
            del self._loading[rid]
            done.add(rid)  # vLLM frees an ended request's blocks only now
            exc = job.exception()
            if cancel.is_set():
                continue
            if exc is None:
                got = job.result()
                self._stats.record(rows=got.rows, code_bytes=got.payload_bytes, seconds=got.seconds,
                                   raw_bytes=got.rows * self._raw_row_bytes)
                log.debug("request %s: %d K/V rows from %s (%d code bytes, %.3f s)", rid, got.rows, got.prefill,
                          got.payload_bytes, got.seconds)
                continue
            self._stats.record(failed=True)
            log.warning("request %s: K/V load failed, vLLM recomputes it: %s", rid, getattr(exc, "message", exc))
            first, last = load.start // self.block_size, (len(load.tokens) - 1) // self.block_size
            self._failed_blocks.update(load.block_ids[first:last + 1])
        return None, done or None

    def _load(self, load: Load, layers: dict, cancel: threading.Event):
        positions = torch.arange(load.start, len(load.tokens))
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            # k, v: [rows, kv_heads, head_dim], k after RoPE: what vLLM's attention caches
            name = self._layer_names[layer]
            cache = self._caches[name]
            attn = layers[name]
            attn.impl.do_kv_cache_update(attn, k.to(cache.device, self.dtype), v.to(cache.device, self.dtype), cache,
                                         slots.to(cache.device))

        return self.source.fetch(load.request_id, load.tokens, load.start, write, cancel=cancel)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request is scheduled only once get_finished reported it

    def get_kv_connector_stats(self) -> SCDConnectorStats | None:
        """This interval's loads (worker side), for vLLM's KV-transfer log line."""
        if self.role != KVConnectorRole.WORKER or self._stats.is_empty():
            return None
        stats, self._stats = self._stats, SCDConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SCDConnectorStats:
        return SCDConnectorStats(data=data) if data else SCDConnectorStats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # consumer only

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self.source.close()
