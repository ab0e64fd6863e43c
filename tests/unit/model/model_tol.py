"""How far two code paths of the same float32 model may differ (tests/unit/model)."""

import torch

ULPS = 256


def cross_path_tol(x: torch.Tensor) -> float:
    """Tolerance for comparing `x` with the same quantity from another code path over the same
    weights (prefill vs extend, a batch of 4 vs one sequence, three chunks vs one): the sums run in
    another order (other GEMM shapes, thread splits, vector kernels), a few ulp per op. Measured up
    to ~20 ulp of max|x| (1.7e-5 at |x| ~ 8) under ATEN_CPU_CAPABILITY=default/avx2 with 1 and 2
    threads; 256 ulp (2.4e-4 at |x| ~ 8) leaves 10x for other kernels, while a misplaced block, a
    wrong position or a wrong mask moves these values by more than 1e-2."""
    return ULPS * torch.finfo(x.dtype).eps * float(x.abs().max())
