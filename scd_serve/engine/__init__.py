"""Continuous batching over a preallocated, paged KV pool.

request.py (the contract: GenerationRequest, SamplingParams, TokenEvent, KVFill),
sequence.py, block_manager.py and scheduler.py (plain Python, no torch), sampler.py,
detokenizer.py, sink.py (LayerSink for KV fills), fill.py, inbox.py (messages to the loop),
runtime_protocol.py (what a runtime must offer), runner.py and step_ahead.py (the torch side),
engine.py (Engine: the step-loop thread and async generate). The stand-in runtime for tests is
scd_serve/testing/fake_runtime.py. Nothing is imported here, so importing the scheduler does
not load torch.
"""
