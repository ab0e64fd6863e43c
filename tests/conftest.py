"""Suite-wide settings: small thread pools so tests behave the same on a 2-core CI machine."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# serving roles build the CPU's C++ decode attention in the background and switch to it when it
# lands: a test's numbers would change mid-run; tests/unit/model/test_model_cpu_kernel.py and a
# served test turn it on
os.environ.setdefault("SCD_CPU_KERNELS", "off")
