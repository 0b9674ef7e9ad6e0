"""Mixture-of-experts MLP on Octavo's kernels: the router (``topk_softmax``) and the experts
(``fused_moe``), with an optional shared expert (Qwen2-MoE).

Expert weights are stacked per projection as 2-D matrices, expert after expert: ``w13`` [E * 2I,
H] (each expert's gate rows, then its up rows) and ``w2`` [E * H, I]. Stacked that way they are
ordinary matmul weights to the rest of Octavo: the loader copies each checkpoint expert into its
rows (never holding a second float copy), load-time int8 / int4 quantization works row by row
(so per expert), and the op sees a [E, N, ...] view of them. The router's weight stays in floats
(quantizing it would change which experts a token picks).

Tensor parallel cuts every expert's intermediate dimension, as vLLM does without expert
parallel: each rank holds all experts' slices and the MLP's output is summed over ranks. With
expert parallel (``enable_expert_parallel``) each rank holds whole experts, a contiguous range of
them; every rank routes every token, runs the pairs its experts take (the others' ids become -1,
which the op skips), and the sum over ranks joins them: the all-reduce the layer ends with anyway,
so expert parallel costs no other collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _C
from ..distributed.parallel_state import all_reduce
from ..distributed.shards import TPShard, split
from .linear import QuantizedWeight, linear, param
from .mlp import GatedMLP


@dataclass(frozen=True)
class MoEConfig:
    """An MoE MLP's shape and routing, and how its checkpoint names the experts' projections."""
    num_experts: int
    top_k: int
    intermediate_size: int            # per expert
    renormalize: bool                 # the chosen experts' weights divided by their sum
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router_name: str = "gate"
    scoring: str = "softmax"          # or "sigmoid"
    softcap: float = 0.0              # router logits soft-capping (0: off)
    shared_intermediate_size: int = 0  # a shared expert every token runs, behind a sigmoid gate

    @classmethod
    def of(cls, hf: dict, width: str = "moe_intermediate_size", **fields) -> MoEConfig:
        """From a Hugging Face config: Qwen2/3-MoE and OLMoE name the count ``num_experts``,
        Mixtral ``num_local_experts``; ``width`` names the experts' intermediate size (Mixtral and
        OLMoE use ``intermediate_size``, the Qwen MoE models a separate one)."""
        return cls(num_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                   intermediate_size=hf[width], renormalize=bool(hf.get("norm_topk_prob", False)),
                   shared_intermediate_size=hf.get("shared_expert_intermediate_size") or 0, **fields)


class FusedMoE(torch.nn.Module):
    """forward(x [T, H]) -> [T, H]: each token through its top_k experts, weighted (and the shared
    expert, gated), summed over tensor-parallel ranks."""

    # Stays float when a model is quantized or packed (see matmul_weights in models/llama.py).
    float_weights = ("router_weight", "shared_gate_weight")
    # The experts' op reads inputs in order: act-order GPTQ experts load as floats (place_quantized).
    takes_input_order = False

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype, shard: TPShard):
        super().__init__()
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {moe.num_experts}], got {moe.top_k}")
        self.moe, self.hidden_size = moe, hidden_size
        # Expert parallel: whole experts [first, end) on this rank; else every expert, cut.
        expert_parallel = shard.expert_parallel and shard.world > 1
        if expert_parallel and moe.num_experts < shard.world:
            raise ValueError(f"expert parallel over {shard.world} ranks needs at least as many experts, "
                             f"got {moe.num_experts}")
        self.experts = split(moe.num_experts, shard.world, shard.rank) if expert_parallel else (0, moe.num_experts)
        self.cut = (0, moe.intermediate_size) if expert_parallel else split(moe.intermediate_size, shard.world,
                                                                              shard.rank)
        rows, local = self.cut[1] - self.cut[0], self.experts[1] - self.experts[0]
        if rows < 1:
            raise ValueError(f"tensor_parallel_size {shard.world} is more than the experts' "
                             f"{moe.intermediate_size} intermediate rows")
        self.router_weight = param(moe.num_experts, hidden_size, dtype=dtype)
        self.w13 = param(local * 2 * rows, hidden_size, dtype=dtype)
        self.w2 = param(local * hidden_size, rows, dtype=dtype)
        # Rows of each expert in the stacks: a repacking that works on panels of rows keeps to these.
        self.expert_rows = {"w13": 2 * rows, "w2": hidden_size}
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = GatedMLP(hidden_size, moe.shared_intermediate_size, dtype, shard)
            self.shared_gate_weight = param(1, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.moe
        topk_weights = torch.empty(x.shape[0], m.top_k, dtype=torch.float32, device=x.device)
        topk_ids = torch.empty(x.shape[0], m.top_k, dtype=torch.int32, device=x.device)
        router_logits = linear(x, self.router_weight)
        _C.ops.topk_softmax(topk_weights, topk_ids, router_logits, m.renormalize, m.scoring, softcap=m.softcap)
        first, end = self.experts
        if end - first < m.num_experts:  # expert parallel: this rank's experts, -1 for the others'
            topk_ids = torch.where((topk_ids >= first) & (topk_ids < end), topk_ids - first, -1).int()
        out = fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, end - first)
        if self.shared is not None:
            out += torch.sigmoid(linear(x, self.shared_gate_weight)) * self.shared.partial(x)
        return all_reduce(out)

    def weight_targets(self, prefix: str) -> dict:
        m, rows = self.moe, self.cut[1] - self.cut[0]
        gate, up, down = m.expert_names
        targets = {f"{prefix}{m.router_name}.weight": (self.router_weight, 0, m.num_experts)}
        for j in range(*self.experts):
            p, i = f"{prefix}experts.{j}.", j - self.experts[0]  # i: its place in this rank's stacks
            targets[f"{p}{gate}.weight"] = (self.w13, 2 * rows * i, rows)
            targets[f"{p}{up}.weight"] = (self.w13, 2 * rows * i + rows, rows)
            targets[f"{p}{down}.weight"] = (self.w2, self.hidden_size * i, self.hidden_size)
        if self.shared is not None:
            targets.update(self.shared.weight_targets(f"{prefix}shared_expert."))
            targets[f"{prefix}shared_expert_gate.weight"] = (self.shared_gate_weight, 0, 1)
        return targets

    def held_rows(self) -> dict[str, torch.Tensor]:
        """Expert parallel: the rows of the whole model's stacks (all experts, as ``octavo
        quantize`` saves them) that this rank's stacks hold; nothing otherwise."""
        first, end = self.experts
        if end - first == self.moe.num_experts:
            return {}
        gate_up = 2 * self.moe.intermediate_size
        return {"w13": torch.arange(first * gate_up, end * gate_up),
                "w2": torch.arange(first * self.hidden_size, end * self.hidden_size)}

    def held_elsewhere(self, prefix: str) -> set[str]:
        """The checkpoint names of the experts other expert-parallel ranks hold."""
        gate, up, down = self.moe.expert_names
        return {f"{prefix}experts.{j}.{name}.weight" for j in range(self.moe.num_experts)
                if not self.experts[0] <= j < self.experts[1] for name in (gate, up, down)}

    def shard_slices(self, prefix: str) -> dict:
        m, whole = self.moe, (*self.cut, self.moe.intermediate_size)
        gate, up, down = m.expert_names
        slices = {}
        cut = self.cut[1] - self.cut[0] < m.intermediate_size  # else whole experts: nothing cut
        for j in range(*self.experts) if cut else ():
            p = f"{prefix}experts.{j}."
            slices.update({f"{p}{gate}.weight": (0, *whole), f"{p}{up}.weight": (0, *whole),
                           f"{p}{down}.weight": (1, *whole)})
        if self.shared is not None:
            slices.update(self.shared.shard_slices(f"{prefix}shared_expert."))
        return slices


def _expert_args(weight: torch.Tensor | QuantizedWeight, num_experts: int, prefix: str) -> dict:
    """The op's arguments for a stack of ``num_experts`` experts, viewed [E, N, ...]."""
    if not isinstance(weight, QuantizedWeight):
        return {prefix: weight.view(num_experts, -1, weight.shape[1])}
    if weight.input_order is not None:
        raise ValueError("expert weights with a permuted input order (act-order GPTQ) are not supported")
    stack = lambda t: None if t is None else t.view(num_experts, -1, *t.shape[1:])  # noqa: E731
    return {prefix: stack(weight.qweight), f"{prefix}_format": weight.weight_format,
            f"{prefix}_scales": stack(weight.scales), f"{prefix}_zeros": stack(weight.zeros),
            f"{prefix}_group_size": weight.group_size}


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              num_experts: int) -> torch.Tensor:
    """x [T, H] through stacked experts (2-D stacks, dense or quantized) -> [T, H] by Octavo's
    ``fused_moe`` op, on x's device."""
    out = torch.empty_like(x)
    _C.ops.fused_moe(out, x, topk_weights=topk_weights, topk_ids=topk_ids, **_expert_args(w13, num_experts, "w13"),
                     **_expert_args(w2, num_experts, "w2"))
    return out


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The same product as a loop over experts in torch (what transformers does: each expert's
    tokens selected, projected, weighted and added back). The benchmarks' baseline."""
    w13, w2 = w13.view(num_experts, -1, x.shape[1]), w2.view(num_experts, x.shape[1], -1)
    acc = torch.promote_types(x.dtype, torch.float32)  # float32 sums, float64 for a float64 reference
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    flat = topk_ids.flatten().long()
    for e in flat[flat >= 0].unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // topk_ids.shape[1]
        gate, up = F.linear(x.index_select(0, tokens), w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.to(acc) * topk_weights.flatten()[pairs, None].to(acc))
    return out.to(x.dtype)
