"""`scd-serve decode`: a decode worker (consumer model) serving the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from contextlib import suppress

from scd_serve.config.methods import AUTO, LOCAL
from scd_serve.config.control import ControlConfig, add_control_arguments
from scd_serve.config.decode import (DEFAULT_CODEBOOK, DEFAULT_CONSUMER, FALLBACKS, PRIOR_TABLE_MODES,
                                     ChooserConfig, DecodeConfig, split_peers)
from scd_serve.config.transport import add_transport_arguments, transport_config_from_args
from scd_serve.control.lifecycle import (add_worker_arguments, advertised, freeze_heap, run_role, start_http,
                                         stop_event)
from scd_serve.errors import ConfigError, ScdError

log = logging.getLogger("scd_serve.decode")
PREFERRED_METHOD, PLAIN_METHOD = "scd", "raw"
ENGINE_POLL_S = 0.2
DEATH_LINGER_S = 2.0  # after engine death: keep answering 503 so routers see /ready drop, then exit 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, model=DEFAULT_CONSUMER, model_help="consumer model directory",
                         codebook=DEFAULT_CODEBOOK, listener="HTTP", port=8100, dialer="the gateway should")
    parser.add_argument("--prefill", default="", help="static prefill peer(s): HOST:PORT[,HOST:PORT]")
    parser.add_argument("--method", default=None,
                        help="default transfer method: auto (the fastest the quality budget allows, per request), "
                             "local, or a method name (default: auto when a codebook loads, else raw)")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="auto picks a transfer method whose top-1 agreement with this model's own next token, "
                             "measured by calibration on held-out prompts (codebook manifest), is at least this "
                             "(default: the codebook's target, 0.95)")
    parser.add_argument("--quality-budget", type=float, default=None,
                        help="auto picks only transfer methods whose calibrated KL is at most this; given, it holds "
                             "beside --min-top1 (default: the codebook's KL budget, for methods without a top-1 "
                             "figure; raw/identity only where producer == consumer)")
    parser.add_argument("--auto-stale-s", type=float, default=ChooserConfig.stale_s,
                        help="auto re-measures a link (or its own prefill speed) not measured for this long")
    parser.add_argument("--fallback", default="local", choices=FALLBACKS,
                        help="when a transfer fails: prefill locally, or fail the request (503)")
    parser.add_argument("--max-attempts", type=int, default=2, help="prefill workers tried per request")
    parser.add_argument("--breaker-failures", type=int, default=3,
                        help="failed transfers in a row that open a prefill worker's circuit breaker")
    parser.add_argument("--breaker-cooldown-s", type=float, default=2.0,
                        help="first pause before one probe transfer to a worker whose breaker opened")
    parser.add_argument("--allow-incompatible", action="store_true",
                        help="accept prefill workers whose handshake differs (unsafe)")
    parser.add_argument("--expect-producer", default="", help="refuse producers with another fingerprint")
    parser.add_argument("--api-key", default=os.environ.get("SCD_API_KEY", ""),
                        help="bearer token for the HTTP API (default: $SCD_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                        help="name(s) clients may put in `model` (all listed by /v1/models; the first is "
                             "reported); default: the model directory's name")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="longest prompt + output (0 = the model's context, lowered to what the KV pool holds)")
    parser.add_argument("--num-blocks", type=int, default=0, help="KV pool blocks of 16 tokens (0 = sized from memory)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="a request still running this long after it arrived ends with 504 (its tokens so far "
                             "streamed); raise it for long generations on slow hardware")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: share of the device's memory this worker may use, weights included; the KV "
                             "pool gets what is left after the weights and a reserve for activations")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0,
                        help="KV pool size in GiB (0 = on CUDA from --gpu-memory-utilization, on the CPU a quarter "
                             "of the RAM available at start); never more than max_num_seqs full sequences need")
    parser.add_argument("--prior-table", default="auto", choices=PRIOR_TABLE_MODES,
                        help="the codebook's token prior for every vocabulary token, made at start so that no "
                             "prompt pays for its unseen tokens (kept in $SCD_CACHE_DIR): on, off, or auto (only "
                             "when predicted within --prior-table-budget-s)")
    parser.add_argument("--prior-table-budget-s", type=float, default=DecodeConfig.prior_table_budget_s,
                        help="with --prior-table auto: the most seconds the table may take to make")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DecodeConfig.max_num_batched_tokens,
                        help="prompt tokens prefilled per engine step: a longer prompt is prefilled in chunks, "
                             "with the running sequences' decode steps between them (more: a faster prefill, "
                             "longer gaps for the others)")
    parser.add_argument("--max-num-seqs", type=int, default=DecodeConfig.max_num_seqs,
                        help="sequences decoding at once (the batch bound); more requests wait for a slot")
    parser.add_argument("--chat-template", default="",
                        help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the seeds of requests that send none (in arrival order), so a fresh server "
                             "answers them alike; default: from entropy")
    parser.add_argument("--json-whitespace", type=int, default=DecodeConfig.json_whitespace,
                        help="structured outputs: the most whitespace characters between two JSON elements "
                             "(0 = compact JSON); a small model can otherwise spend its max_tokens on blanks")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=DecodeConfig.enable_prefix_caching,
                        help="keep finished requests' full K/V blocks and reuse them for prompts that start with "
                             "the same tokens (multi-turn chats, shared system prompts; evicted LRU when the pool "
                             "needs room); --no-enable-prefix-caching turns it off")
    add_transport_arguments(parser)
    add_control_arguments(parser)


def check_exposure(config: DecodeConfig, control: ControlConfig, insecure: bool) -> None:
    from scd_serve.control.exposure import control_plane, listener, refuse_open

    refuse_open("decode", [listener("HTTP API", config.host, bool(config.api_key), "set $SCD_API_KEY or --api-key"),
                           control_plane(config.control_url, control.secret)], insecure)


def config_from_args(args) -> DecodeConfig:
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(DecodeConfig) if hasattr(args, f.name)}
    return DecodeConfig(**flags | dict(  # the flags named as fields, then the rest
        codebook=DEFAULT_CODEBOOK if args.codebook is None else args.codebook,
        prefill=split_peers(args.prefill), method=args.method or AUTO, transport=transport_config_from_args(args),
        chooser=ChooserConfig(quality_budget=args.quality_budget, min_top1=args.min_top1, stale_s=args.auto_stale_s),
        served_model_names=tuple(args.served_model_name)))


def resolve_method(rt, codebook, method: str, explicit: bool) -> str:
    """The server default method: `scd` (and the default `auto`) need a codebook calibrated
    for this consumer; without one an implicit default drops to `raw` with a warning, an
    explicit --method scd is a configuration error (an explicit --method auto then picks
    among the lossless methods and local). codebook: a directory or None."""
    from scd_serve import codec as codec_registry
    from scd_serve.codec.codebook import Codebook

    if method == "local":
        return method
    try:
        producer = rt  # codebook-free methods: any same-shape producer spec will do for this check
        if codebook is not None:  # the producer is the one the codebook was calibrated for
            codebook = Codebook.load(codebook, consumer=rt)
            producer = codebook.side_spec("producer")
        if method == AUTO:
            if codebook is None and not explicit:
                raise ConfigError("no codebook loaded")
            return method
        codec_registry.build(method, producer=producer, consumer=rt, codebook=codebook)
        return method
    except (ScdError, ValueError, OSError) as exc:
        why = getattr(exc, "message", str(exc))
        if explicit or method not in (PREFERRED_METHOD, AUTO):
            raise ConfigError(f"--method {method} cannot be used here: {why}") from None
        log.warning("method %s unavailable (%s); serving %s by default", method, why, PLAIN_METHOD)
        return PLAIN_METHOD


def kv_budget(rt, config: DecodeConfig):
    """The pool's blocks and max_model_len from the memory this worker may use (engine/kv_budget.py);
    the settings come validated in `config`."""
    import torch

    from scd_serve.config.engine import EngineConfig
    from scd_serve.engine import kv_budget as kb

    kv_cache_gib, gpu_memory_utilization = config.kv_cache_gib, config.gpu_memory_utilization
    # the block size, batch bound and prefill chunk the worker runs with
    eng = EngineConfig(max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_num_batched_tokens,
                       max_concurrent=max(EngineConfig.max_concurrent, config.max_num_seqs))
    spec, size = rt.spec, torch.empty((), dtype=rt.dtype).element_size()
    if kv_cache_gib:
        budget, source = int(kv_cache_gib * kb.GIB), f"--kv-cache-gib {kv_cache_gib}"
    elif rt.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(rt.device)
        reserve = kb.activation_reserve(spec.hidden_size, spec.intermediate_size, spec.vocab_size,
                                        eng.max_prefill_tokens, eng.max_num_seqs, size)
        budget = max(0, int(gpu_memory_utilization * total) - (total - free) - reserve)
        source = f"--gpu-memory-utilization {gpu_memory_utilization} of {total / kb.GIB:.1f} GiB"
    else:
        budget, source = available_ram() // 4, "a quarter of the RAM available at start"
    return kb.size_pool(token_bytes=kb.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, size),
                        block_size=eng.block_size, budget_bytes=budget, model_context=spec.max_position_embeddings,
                        max_num_seqs=eng.max_num_seqs, num_blocks=config.num_blocks, max_model_len=config.max_model_len,
                        budget_from=source)


def chat_template(value: str, tokenizer) -> str:
    """--chat-template: a file's text, or the value itself when it is a template; rendered once
    here, so a broken one stops the worker at start, not each chat request."""
    if not value:
        return ""
    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" not in value and "{%" not in value:
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=text, tokenize=False,
                                      add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja's errors, whatever they are
        raise ConfigError(f"--chat-template does not render a one-message chat: {str(exc)[:200]}") from None
    return text


CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # (limit, usage): cgroup v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_ram() -> int:
    """Bytes of RAM this process may still use: Linux MemAvailable, lowered to what the cgroup's
    memory limit leaves (a container sees the host's /proc/meminfo, not its own limit)."""
    free = None
    with suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    if free is None:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit, usage in CGROUP_MEMORY:
        try:
            with open(limit) as f, open(usage) as g:
                cap = f.read().strip()
                if cap.isdigit() and int(cap) < 1 << 60:  # "max" or a huge v1 value: no limit
                    free = min(free, max(0, int(cap) - int(g.read().strip())))
                break
        except (OSError, ValueError):
            continue
    return free


async def serve(config: DecodeConfig, explicit_method: bool, control: ControlConfig | None = None,
                codebook_chosen: bool = False) -> bool:
    """Run until SIGINT/SIGTERM (returns False) or until the engine loop dies (returns True).
    codebook_chosen: --codebook was given (flag or $SCD_CODEBOOK), so it must fit the model."""
    import uvicorn

    from scd_serve.api.http_server import http_config
    from scd_serve.codec.codebook import codebook_arg, refuse_other_pair
    from scd_serve.config.api import ApiConfig
    from scd_serve.config.engine import EngineConfig
    from scd_serve.control.fanout import HeartbeatFanout
    from scd_serve.control.preflight import check_model_dir, check_port
    from scd_serve.decode.worker import DecodeWorker
    from scd_serve.model.threads import load_for_serving

    check_port(config.host, config.port)
    check_model_dir(config.model)
    stop = stop_event()
    rt = load_for_serving(config.model, config.device, config.dtype)
    if codebook_chosen and codebook_arg(config.codebook):
        refuse_other_pair(config.codebook, "--model", consumer=rt)
    method = resolve_method(rt, codebook_arg(config.codebook), config.method, explicit_method)
    config = dataclasses.replace(config, method=method)
    pool = kv_budget(rt, config)
    log.info("%s", pool.note)
    max_len = pool.max_model_len
    engine_cfg = EngineConfig(max_model_len=max_len, num_blocks=pool.num_blocks, max_num_seqs=config.max_num_seqs,
                              max_prefill_tokens=config.max_num_batched_tokens,
                              max_concurrent=max(EngineConfig.max_concurrent, config.max_num_seqs), seed=config.seed,
                              json_whitespace=config.json_whitespace, prefix_caching=config.enable_prefix_caching,
                              request_timeout_s=config.request_timeout_s, fallback_to_local=config.fallback == "local")
    template = chat_template(config.chat_template, rt.tokenizer)
    model_name = os.path.basename(os.path.normpath(config.model))
    api_cfg = ApiConfig(host=config.host, port=config.port, model_name=model_name, model_root=config.model,
                        api_key=config.api_key,
                        served_model_names=config.served_model_names,
                        max_model_len=max_len, max_tokens_cap=max_len, default_method=method,
                        request_timeout_s=config.request_timeout_s, chat_template=template)
    worker = await DecodeWorker(rt, config, engine_cfg, api_cfg).start()
    app, engine, backend, peers, auto = worker.app, worker.engine, worker.backend, worker.peers, worker.auto
    freeze_heap()
    server = uvicorn.Server(http_config(app, config.host, config.port, header_timeout_s=api_cfg.header_timeout_s,
                                        timeout_keep_alive=api_cfg.timeout_keep_alive_s,
                                        timeout_graceful_shutdown=int(config.shutdown_grace_s)))
    http, port = await start_http(server)
    address = advertised(config.advertise, config.host, port)
    heartbeat = None
    if config.control_url:
        heartbeat = HeartbeatFanout(config.control_url, "decode", address, backend.ready, backend.load_report,
                                    control or ControlConfig(), on_peers=peers.update_from_registry,
                                    models=tuple(app.state.model_names))  # the gateway's model_name labels
        heartbeat.start()
    print(f"decode worker serving http://{config.host}:{port} (advertised {address}), consumer {rt.fingerprint} "
          f"on {rt.device} in {str(rt.dtype).removeprefix('torch.')}, default method {method}, fallback {config.fallback}"
          + (f", quality budget {auto.chooser.budget:g}" if method == AUTO else ""), flush=True)
    if not peers.ready() and method != LOCAL:
        log.warning("not ready yet: %s", peers.why_not_ready())
    died = await stopped_or_died(stop, engine)
    if died:  # /ready already says 503; answer 503 a moment longer, then exit nonzero for the supervisor
        log.error("engine loop died; exiting in %.0f s so a supervisor restarts this worker", DEATH_LINGER_S)
        await asyncio.sleep(DEATH_LINGER_S)
    log.info("shutting down: draining HTTP for up to %.0f s", config.shutdown_grace_s)
    if heartbeat is not None:
        await heartbeat.close()
    server.should_exit = True
    await worker.drain(config.shutdown_grace_s)
    log.debug("engine stopped")
    await http
    log.debug("http stopped")
    await worker.close()
    log.info("stopped")
    return died


async def stopped_or_died(stop: asyncio.Event, engine) -> bool:
    """Wait for a stop signal or the engine loop's death (it never comes back); True if it died."""
    async def death() -> None:
        while engine.loop_alive():  # not ready(): that also turns false on a stall, which is not death
            await asyncio.sleep(ENGINE_POLL_S)

    tasks = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(death())]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return tasks[1] in done


def run(args) -> int:
    run_role("decode", args, config_from_args, check_exposure,
             lambda config, control: serve(config, args.method is not None, control, args.codebook is not None))
