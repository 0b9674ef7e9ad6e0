"""Dense projections: Octavo's ``linear`` kernel where it beats torch, torch's GEMM elsewhere.

Crossover measured on the development machine (AMD EPYC, AVX-512 with BF16, 2 threads, torch
2.13 CPU) at the default model's shapes (960x576, 3072x576, 576x1536, 49152x576), rows = M:
- float32: Octavo's kernel is faster at every M from 1 to 2048 (M = 1: 2-3x; prefill M = 512:
  1.4-1.7x; torch's MKL float32 GEMM is slow on this AMD CPU), so it is used at every M.
- float16: torch's CPU float16 GEMM is 3-6x slower at every M: always Octavo's kernel.
- bfloat16: Octavo's kernel (vdpbf16ps) wins up to M = 16 (M = 1: 1.3-5x); from M = 32
  torch's oneDNN GEMM (packed, larger register blocks) is faster.
Octavo's kernel computes each output row the same way for every M, so decode batches of any
size at or below the crossover give bit-identical rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _C

# The smallest row count at which torch's GEMM takes over, per dtype.
TORCH_FROM_ROWS = {torch.float32: math.inf, torch.float16: math.inf, torch.bfloat16: 32}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] contiguous, bias [N] or None -> [M, N]."""
    if x.device.type != "cpu" or x.shape[0] >= TORCH_FROM_ROWS.get(x.dtype, 0):
        return F.linear(x, weight, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _C.ops.linear(out, x, weight, bias)
    return out
