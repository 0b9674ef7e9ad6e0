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


class QuantizedWeight(torch.nn.Module):
    """A projection weight kept in a GGUF block format ("q8_0", "q4_0", "q4_1"): ``blocks`` is
    uint8 [N, K / 32 * block bytes] as the file stores it; ``linear`` decodes it in registers."""

    def __init__(self, blocks: torch.Tensor, weight_format: str, in_features: int):
        super().__init__()
        self.register_buffer("blocks", blocks.contiguous())
        self.weight_format, self.in_features = weight_format, in_features
        expected = in_features // 32 * _C.ops.weight_block_bytes(weight_format)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise ValueError(f"{weight_format} blocks for {in_features} inputs must be uint8 [N, {expected}], "
                             f"got {blocks.dtype} {list(blocks.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.in_features

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights the blocks stand for."""
        out = torch.empty(self.shape)
        _C.ops.dequantize(out, self.blocks, self.weight_format)
        return out

    def extra_repr(self) -> str:
        return f"{self.weight_format}, shape={list(self.shape)}"


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] contiguous or quantized, bias [N] or None -> [M, N]."""
    if isinstance(weight, QuantizedWeight):  # Octavo's kernel at every M (no torch kernel reads the blocks)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        _C.ops.linear(out, x, weight.blocks, bias, weight_format=weight.weight_format)
        return out
    if x.device.type != "cpu" or x.shape[0] >= TORCH_FROM_ROWS.get(x.dtype, 0):
        return F.linear(x, weight, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _C.ops.linear(out, x, weight, bias)
    return out
