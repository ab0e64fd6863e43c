"""Suite-wide settings: small thread pools so tests behave the same on a 2-core CI machine."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
