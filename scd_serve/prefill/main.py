"""`scd-serve prefill`: a prefill worker (producer model) serving scd.v1.PrefillService."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from scd_serve.config.control import ControlConfig, add_control_arguments
from scd_serve.config.prefill import DEFAULT_CODEBOOK, DEFAULT_PRODUCER, PrefillConfig
from scd_serve.config.transport import add_transport_arguments, transport_config_from_args
from scd_serve.control.lifecycle import add_worker_arguments, advertised, freeze_heap, run_role, stop_event
from scd_serve.errors import ConfigError

log = logging.getLogger("scd_serve.prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, model=DEFAULT_PRODUCER, model_help="producer model directory",
                         codebook=DEFAULT_CODEBOOK, listener="gRPC", port=50051, dialer="decode workers should")
    parser.add_argument("--max-concurrent", type=int, default=4, help="transfers at once; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--cache-mb", type=int, default=256, help="code cache for repeated prompts (MiB, 0 = off)")
    parser.add_argument("--expert-codebook", dest="expert_codebooks", action="append", default=[], metavar="DIR",
                        help="the codebook of a further consumer (expert) this producer feeds, repeatable: one "
                             "prefill pool serves several experts, each decode worker the codes of its own")
    parser.add_argument("--prefix-cache-tokens", type=int, default=PrefillConfig.prefix_cache_tokens,
                        help="the producer's prefix cache: K/V of this many tokens kept so that a prompt starting "
                             "with one seen before (a chat's next turn) is prefilled from there on (0 = off)")
    parser.add_argument("--transfer-lease-s", type=float, default=60.0)
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="longest prompt accepted, in tokens (0 = the model's max_position_embeddings)")
    parser.add_argument("--chunk-bytes", type=int, default=PrefillConfig.chunk_bytes,
                        help="cached codes resent in chunks of up to this size, the first and the last "
                             "layer alone (1 = one layer per chunk)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus GET /metrics on this HTTP port, behind the worker token (0 = none)")
    parser.add_argument("--engine", choices=("scd-serve", "vllm"), default="scd-serve",
                        help="what computes the producer's prefill: scd-serve's own engine, or vLLM's (installed in "
                             "this Python; one prompt at a time, no producer prefix cache: docs/vllm.md)")
    parser.add_argument("--vllm-args", default="", metavar="JSON",
                        help="with --engine vllm: more arguments for vLLM's engine (vllm.LLM), a JSON object, "
                             "e.g. '{\"gpu_memory_utilization\": 0.5}'")
    add_transport_arguments(parser)
    add_control_arguments(parser)


def check_exposure(config: PrefillConfig, control: ControlConfig, insecure: bool) -> None:
    from scd_serve.control.exposure import control_plane, listener, refuse_open

    t = config.transport
    hint = "set $SCD_WORKER_TOKEN / --worker-token, or mTLS with --tls-cert/--tls-key/--tls-ca"
    metrics = listener("metrics HTTP", config.host, bool(t.worker_token), "set $SCD_WORKER_TOKEN / --worker-token")
    refuse_open("prefill", [listener("gRPC", config.host, bool(t.worker_token) or bool(t.tls and t.tls_ca), hint),
                            metrics if config.metrics_port else None,
                            control_plane(config.control_url, control.secret)], insecure)


def config_from_args(args) -> PrefillConfig:
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(PrefillConfig) if hasattr(args, f.name)}
    return PrefillConfig(**flags | dict(max_prompt_tokens=args.max_model_len, cache_bytes=args.cache_mb << 20,
                                        expert_codebooks=tuple(args.expert_codebooks),
                                        codebook=DEFAULT_CODEBOOK if args.codebook is None else args.codebook,
                                        transport=transport_config_from_args(args)))


def build_codecs(rt, codebook: str, methods=None) -> dict:
    """Every method the registry knows (or of `methods`) that builds here (scd needs a codebook)."""
    from scd_serve import codec as codec_registry
    from scd_serve.codec.codebook import codebook_arg
    from scd_serve.errors import ScdError

    codecs, skipped, book = {}, {}, codebook_arg(codebook)
    for method in methods or codec_registry.METHODS:
        try:
            codecs[method] = codec_registry.build(method, producer=rt, codebook=book)
        except (ScdError, ValueError, OSError) as exc:
            skipped.setdefault(str(getattr(exc, "message", exc)), []).append(method)
    for why, methods in skipped.items():
        log.info("not offered: %s (%s)", ", ".join(methods), why)
    return codecs


async def serve(config: PrefillConfig, control: ControlConfig | None = None, codebook_chosen: bool = False,
                load=None) -> None:
    """Serve until SIGINT/SIGTERM; codebook_chosen: --codebook was given, so it must fit the model;
    load(config) -> the producer runtime (default: scd-serve's own, ModelRuntime)."""
    from scd_serve.codec.codebook import codebook_arg, refuse_other_pair
    from scd_serve.control.fanout import HeartbeatFanout
    from scd_serve.control.preflight import check_model_dir, check_port
    from scd_serve.model.threads import load_for_serving
    from scd_serve.prefill.worker import PrefillWorker

    check_port(config.host, config.port)
    check_port(config.host, config.metrics_port, "--metrics-port")
    check_model_dir(config.model)
    stop = stop_event()
    # vLLM's engine starts from here, its threads its own; ours is loaded off this thread (threads.py)
    rt = load(config) if load else load_for_serving(config.model, config.device, config.dtype)
    if codebook_chosen and codebook_arg(config.codebook):
        refuse_other_pair(config.codebook, "--model", producer=rt)
    codecs = build_codecs(rt, config.codebook)
    experts = []
    for book in config.expert_codebooks:  # each must be for this producer; its codebook methods only
        from scd_serve.codec import NEEDS_CODEBOOK

        refuse_other_pair(book, "--model", producer=rt)
        experts.append(build_codecs(rt, book, sorted(NEEDS_CODEBOOK)))
    worker = PrefillWorker(rt, codecs, config, experts=experts)
    freeze_heap()
    await worker.start()
    servicer, port = worker.servicer, worker.port
    address = advertised(config.advertise, config.host, port)
    heartbeat = None
    if config.control_url:
        heartbeat = HeartbeatFanout(config.control_url, "prefill", address, lambda: not stop.is_set(),
                                    servicer.load_report, control or ControlConfig())
        heartbeat.start()
    metrics_http = None
    if config.metrics_port:
        import uvicorn

        from scd_serve.prefill.metrics import metrics_app

        metrics_http = uvicorn.Server(uvicorn.Config(metrics_app(servicer.metrics, config.transport.worker_token),
                                                     host=config.host, port=config.metrics_port, log_level="warning"))
        metrics_http.install_signal_handlers = lambda: None  # stop_event() owns SIGINT/SIGTERM
        metrics_task = asyncio.create_task(metrics_http.serve())
    print(f"prefill worker serving on {config.host}:{port} (advertised {address}), producer {rt.fingerprint}, "
          f"methods {', '.join(codecs)}" + (f", {len(experts)} more expert codebook(s)" if experts else "")
          + (f", metrics on :{config.metrics_port}" if metrics_http else ""), flush=True)
    await stop.wait()
    if metrics_http is not None:
        metrics_http.should_exit = True
        await metrics_task
    log.info("shutting down: NOT_SERVING, finishing transfers for up to %.0f s", config.shutdown_grace_s)
    await worker.drain()
    if heartbeat is not None:
        await heartbeat.close()
    await worker.stop(config.shutdown_grace_s)


def run(args) -> int:
    if args.vllm_args:
        raise ConfigError("--vllm-args is for --engine vllm")
    run_role("prefill", args, config_from_args, check_exposure,
             lambda config, control: serve(config, control, args.codebook is not None))
