"""Offline calibration of an SCD codebook, between the codec (what serving runs) and quality
(the CLIs and the measurements against the oracle): paired states and their fits, the KL probe,
the plan search, the run and replay choice, distillation, and assembly into a codebook."""
