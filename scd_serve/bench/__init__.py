"""Benchmarks: TTFT over a shaped link (`bench ttft`), serving load (`bench serve`), planner (`plan`)."""
