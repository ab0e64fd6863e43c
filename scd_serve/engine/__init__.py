"""Continuous batching over a preallocated, paged KV pool (engine.py's Engine). Nothing is imported
here, so the plain-Python bookkeeping (request, sequence, block_manager, scheduler) loads without torch."""
