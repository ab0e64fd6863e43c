"""Continuous batching over a preallocated, paged KV pool.

request.py (the contract: GenerationRequest, SamplingParams, TokenEvent, KVFill),
sequence.py, block_manager.py and scheduler.py (plain Python, no torch), sampler.py,
detokenizer.py, sink.py (LayerSink for KV fills), fill.py, runner.py (the torch side),
engine.py (Engine: the step-loop thread and async generate), toy.py (a stand-in runtime
for tests). Nothing is imported here, so importing the scheduler does not load torch.
"""
