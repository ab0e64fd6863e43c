"""Suite-wide settings: small thread pools so tests behave the same on a 2-core CI machine."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The serving roles' `--dtype auto` is bfloat16 on CPUs that multiply it natively (model/loader.py);
# the suite's workers run float32 on every machine, so that its greedy comparisons mean the same
# everywhere (the choice itself: tests/unit/model/test_model_dtype.py; a test may set its own).
os.environ.setdefault("SCD_DTYPE", "float32")
