"""`scd-serve plan`: payload and TTFT projected for real model shapes, from their configs and
from a calibrated codebook's ranks (a projection, not a measurement: bench/ measures)."""
