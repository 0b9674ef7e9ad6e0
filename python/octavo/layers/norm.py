"""RMSNorm on Octavo's kernels."""

from __future__ import annotations

import torch

from .. import _C


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * weight`` (``weight_offset``: ``* (1 + weight)``, Gemma's, 1 + weight taken in
    float32). With a residual, adds it first (in place) and returns both, as vLLM's fused form:
    ``forward(x, residual) -> (normed, x + residual)``."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, weight_offset: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps, self.weight_offset = eps, weight_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = torch.empty_like(x)
            _C.ops.rms_norm(out, x, self.weight, self.eps, self.weight_offset)
            return out
        _C.ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        return x, residual
