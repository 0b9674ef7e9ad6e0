"""The dense gated MLP of Llama-family models (and Qwen2-MoE's shared expert)."""

from __future__ import annotations

import torch

from .. import _C
from ..distributed.parallel_state import all_reduce
from ..distributed.shards import TPShard, split
from .linear import linear, param


# Hugging Face's hidden_act / hidden_activation names -> the gated kernel and its argument.
ACTIVATIONS = {"silu": ("silu_and_mul", ()), "gelu": ("gelu_and_mul", ("none",)),
               "gelu_pytorch_tanh": ("gelu_and_mul", ("tanh",))}


class GatedMLP(torch.nn.Module):
    """act(gate(x)) * up(x) -> down, column-parallel gate_up, row-parallel down (the rank's
    part of ``intermediate_size``); act is SiLU (Llama) or a GELU (Gemma's tanh approximation).
    ``partial`` leaves the sum over ranks to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, shard: TPShard,
                 activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        kernel, self.act_args = ACTIVATIONS[activation]
        self.act = getattr(_C.ops, kernel)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.cut = split(intermediate_size, shard.world, shard.rank)
        rows = self.cut[1] - self.cut[0]
        self.gate_up_weight = param(2 * rows, hidden_size, dtype=dtype)
        self.down_weight = param(hidden_size, rows, dtype=dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight)
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
        self.act(out, gate_up, *self.act_args)
        return linear(out, self.down_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x))

    def weight_targets(self, prefix: str) -> dict:
        rows = self.cut[1] - self.cut[0]
        return {f"{prefix}gate_proj.weight": (self.gate_up_weight, 0, rows),
                f"{prefix}up_proj.weight": (self.gate_up_weight, rows, rows),
                f"{prefix}down_proj.weight": (self.down_weight, 0, self.hidden_size)}

    def shard_slices(self, prefix: str) -> dict:
        whole = (*self.cut, self.intermediate_size)
        return {f"{prefix}gate_proj.weight": (0, *whole), f"{prefix}up_proj.weight": (0, *whole),
                f"{prefix}down_proj.weight": (1, *whole)}
