"""Continuous batching over a preallocated, paged KV pool (engine.py's Engine).

Nothing is imported here, so importing the plain-Python bookkeeping (request, sequence,
block_manager, scheduler) does not load torch.
"""
