"""bfloat16 weights kept as AMX weight tiles (weight format "bf16_tiles").

On the ``amx`` kernel level, ``linear`` multiplies bfloat16 on AMX tiles, whose weight operand
must be in "VNNI" layout (pairs of inputs interleaved per output feature). A dense weight is
transposed into that layout on every call, which at decode batch sizes costs more than the
multiplies; packed once at load, a call only reads it. Over the default model's weights read from
DRAM as a decode step reads them (bench/python/bench_bf16_tiles.py): 1.5-1.6x as fast at 8-16
rows, 1.25-1.35x at 32-64, the same at 1-4 rows (bench/RESULTS.md).

``pack_model`` packs a CPU bfloat16 model's projections and LM head where the kernel level is
``amx`` and the measured crossover (``layers/crossover.py``) has torch's GEMM win at no row
count: torch cannot read the packed layout, so a model whose prefill torch does faster keeps its
dense weights. A tied LM head gets its own packed copy (the embedding stays a table for lookups),
as it does in int8 (``layers/quantize.py``). ``OCTAVO_BF16_TILES=0`` turns packing off.
"""

from __future__ import annotations

import math
import os

import torch

from .. import _C
from .linear import TORCH_FROM_ROWS, QuantizedWeight
from .quantize import replace_weight

FORMAT = "bf16_tiles"


def pack(weight: torch.Tensor) -> QuantizedWeight:
    """A bfloat16 [N, K] CPU weight (N and K multiples of 32) in the packed format."""
    data = torch.empty(weight.shape[0], weight.shape[1] * 2, dtype=torch.uint8)
    _C.ops.pack_bf16_tiles(data, weight.contiguous())
    return QuantizedWeight(data, FORMAT, weight.shape[1])


def packable(weight, part_rows: int = 32) -> bool:
    """``part_rows``: rows of each matrix stacked in ``weight`` (an expert's, layers/moe.py); the
    tiles hold 32 rows, so a part must not end inside one."""
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0 and part_rows % 32 == 0)


def worth_packing(model) -> bool:
    """Whether this machine runs the model's products faster on packed weights (module docstring)."""
    return (os.environ.get("OCTAVO_BF16_TILES", "1") != "0" and model.dtype == torch.bfloat16
            and _C.cpu_isa() == "amx" and TORCH_FROM_ROWS.get(torch.bfloat16) == math.inf)


def pack_model(model) -> int:
    """Packs every packable matmul weight of ``model`` in place; returns how many it packed."""
    packed = 0
    for module, attr, _ in model.matmul_weights():
        weight = getattr(module, attr)
        if packable(weight, getattr(module, "expert_rows", {}).get(attr, 32)):
            replace_weight(module, attr, pack(weight.data))
            packed += 1
    return packed
