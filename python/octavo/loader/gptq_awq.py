"""4-bit GPTQ and AWQ checkpoints, repacked at load time into Octavo's int4 layout.

The layouts, as the GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq" and "gptq_v2") and AWQ
("gemm" version) checkpoints on the Hugging Face hub store them, for a Linear of K inputs and N
outputs with groups of g inputs:
- GPTQ: qweight int32 [K / 8, N], nibble i of qweight[r, n] is q[8r + i, n]; qzeros int32
  [K / g, N / 8], nibble i of qzeros[t, c] is the zero of output 8c + i, stored minus one in
  format "gptq" (v1) and as is in "gptq_v2"; scales [K / g, N]; g_idx int32 [K], the group of
  each input (act-order checkpoints: not sorted).
- AWQ: qweight int32 [K, N / 8] and qzeros int32 [K / g, N / 8], packed along the outputs with
  nibble i holding output 8c + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7); scales [K / g, N].
Both mean w[n, k] = (q - z) * s. An act-order GPTQ weight is stored with its inputs sorted by
group, and ``QuantizedWeight.input_order`` gathers the activations the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.linear import QuantizedWeight
from ..layers.quantize import pack_nibbles, place_quantized

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
METHODS = ("gptq", "awq")


def check_config(quant: dict) -> None:
    method = quant.get("quant_method")
    if quant.get("bits", 4) != 4:
        raise ValueError(f"{method} checkpoints with {quant.get('bits')} bits are not supported (4 bits only)")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {quant.get('version')!r} is not supported (gemm only)")
    if method == "awq" and not quant.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")


def _nibbles(packed: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int32 [..] -> uint8 with 8x the size along ``dim``: nibble i goes to position 8j + order[i]."""
    parts = [(packed >> (4 * i)) & 15 for i in range(8)]
    ordered = [None] * 8
    for i, o in enumerate(order):
        ordered[o] = parts[i]
    return torch.stack(ordered, dim=dim + 1).flatten(dim, dim + 1).to(torch.uint8)


@dataclass
class Unpacked:
    """A GPTQ / AWQ Linear's integers in the inputs' own order: q uint8 [N, K], zeros uint8 and
    scales float32 [N, G], and ``groups`` int64 [K], the group of each input."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def cut(self, dim: int, begin: int, end: int) -> Unpacked | None:
        """Outputs (dim 0) or inputs (dim 1) [begin, end): a tensor-parallel rank's part. An
        input cut keeps the groups it holds, and is None where it would hold a group in part
        beside other groups, or groups that are not a multiple of 32 inputs (the int4 layout
        needs groups of one size, a multiple of 32)."""
        if dim == 0:
            return Unpacked(self.q[begin:end], self.zeros[begin:end], self.scales[begin:end], self.groups)
        groups = self.groups[begin:end]
        present, local, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        whole = torch.bincount(self.groups)[present]
        if (len(present) > 1 and not torch.equal(counts, whole)) or (end - begin) // len(present) % 32:
            return None
        return Unpacked(self.q[:, begin:end], self.zeros[:, present], self.scales[:, present], local)

    def sorted_by_group(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K] with the inputs sorted by group, zeros, scales, the input order or None when
        they are sorted already), the parts ``quantized_weight`` takes."""
        n_groups, k = self.scales.shape[1], self.q.shape[1]
        g = k // n_groups
        if torch.equal(self.groups, torch.arange(k) // g):
            return self.q.contiguous(), self.zeros.contiguous(), self.scales.contiguous(), None
        if not torch.equal(torch.bincount(self.groups, minlength=n_groups), torch.full((n_groups,), g)):
            raise ValueError("GPTQ g_idx does not put the same number of inputs in every group")
        order = torch.argsort(self.groups, stable=True)
        return self.q[:, order].contiguous(), self.zeros.contiguous(), self.scales.contiguous(), order


def unpack(method: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           g_idx: torch.Tensor | None, zero_offset: int) -> Unpacked:
    if method == "gptq":
        q = _nibbles(qweight, 0).t()
        zeros = (_nibbles(qzeros, 1).int() + zero_offset).clamp(0, 255).to(torch.uint8).t()
    else:
        q = _nibbles(qweight, 1, AWQ_ORDER).t()
        zeros = _nibbles(qzeros, 1, AWQ_ORDER).t()
    k, n_groups = q.shape[1], scales.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // (k // n_groups)
    return Unpacked(q, zeros, scales.t().float(), groups)


def quantized_weight(parts: list[tuple]) -> QuantizedWeight | None:
    """One int4 weight from the unpacked parts of a fused projection (rows concatenated), or None
    when the parts' input orders differ (the fused weight is then kept in floats)."""
    orders = [p[3] for p in parts]
    group_size = parts[0][0].shape[1] // parts[0][2].shape[1]
    if any((o is None) != (orders[0] is None) or (o is not None and not torch.equal(o, orders[0])) for o in orders):
        return None
    q = torch.cat([p[0] for p in parts])
    return QuantizedWeight(pack_nibbles(q), "int4", q.shape[1], scales=torch.cat([p[2] for p in parts]),
                           zeros=torch.cat([p[1] for p in parts]), group_size=group_size, input_order=orders[0])


def load_gptq_awq(model, tensors: dict[str, torch.Tensor], quant: dict) -> None:
    """Float tensors as they are; each GPTQ / AWQ Linear unpacked and kept in int4 wherever all
    parts of a fused weight agree (see place_quantized), else dequantized into the float weight.
    Tensor parallel: each Linear's integers are cut to this rank's part (``model.shard_slices``);
    a part that cannot stay int4 (an input cut inside a group) is loaded as floats, which
    ``load_weights`` cuts."""
    check_config(quant)
    method = quant["quant_method"]
    zero_offset = 1 if method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq" else 0
    slices = model.shard_slices()
    unpacked, parts, floats = {}, {}, []
    for name, tensor in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            missing = [f"{prefix}.{p}" for p in ("qzeros", "scales") if f"{prefix}.{p}" not in tensors]
            if missing:
                raise ValueError(f"the checkpoint has {name} but lacks {' and '.join(missing)}")
            weight = f"{prefix}.weight"
            unpacked[weight] = unpack(method, tensor, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                                      tensors.get(f"{prefix}.g_idx"), zero_offset)
            cut = slices.get(weight)
            part = unpacked[weight] if cut is None else unpacked[weight].cut(*cut[:3])
            if part is not None:
                parts[weight] = part.sorted_by_group()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            floats.append((name, tensor))
    shapes = {name: tuple(p[0].shape) for name, p in parts.items()}
    placed = place_quantized(model, shapes, lambda names: quantized_weight([parts[name] for name in names]))
    floats += [(name, quantized_weight([u.sorted_by_group()]).dequantize())
               for name, u in unpacked.items() if name not in placed]
    model.load_weights(floats)
