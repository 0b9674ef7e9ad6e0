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


def unpack(method: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           g_idx: torch.Tensor | None, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q uint8 [N, K], zeros uint8 [N, K / g], scales float32 [N, K / g], input order or None),
    with the inputs sorted by group when g_idx is not already."""
    if method == "gptq":
        q = _nibbles(qweight, 0).t()
        zeros = (_nibbles(qzeros, 1).int() + zero_offset).clamp(0, 255).to(torch.uint8).t()
    else:
        q = _nibbles(qweight, 1, AWQ_ORDER).t()
        zeros = _nibbles(qzeros, 1, AWQ_ORDER).t()
    order = None
    if g_idx is not None:
        groups, g = scales.shape[0], q.shape[1] // scales.shape[0]
        if not torch.equal(g_idx.long(), torch.arange(q.shape[1]) // g):
            order = torch.argsort(g_idx.long(), stable=True)
            if not torch.equal(torch.bincount(g_idx.long(), minlength=groups), torch.full((groups,), g)):
                raise ValueError("GPTQ g_idx does not put the same number of inputs in every group")
            q = q[:, order]
    return q.contiguous(), zeros.contiguous(), scales.t().float().contiguous(), order


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
    parts of a fused weight agree (see place_quantized), else dequantized into the float weight."""
    check_config(quant)
    method = quant["quant_method"]
    zero_offset = 1 if method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq" else 0
    unpacked, floats = {}, []
    for name, tensor in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            missing = [f"{prefix}.{p}" for p in ("qzeros", "scales") if f"{prefix}.{p}" not in tensors]
            if missing:
                raise ValueError(f"the checkpoint has {name} but lacks {' and '.join(missing)}")
            unpacked[f"{prefix}.weight"] = unpack(method, tensor, tensors[f"{prefix}.qzeros"],
                                                  tensors[f"{prefix}.scales"], tensors.get(f"{prefix}.g_idx"),
                                                  zero_offset)
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            floats.append((name, tensor))
    shapes = {name: tuple(parts[0].shape) for name, parts in unpacked.items()}
    placed = place_quantized(model, shapes, lambda names: quantized_weight([unpacked[name] for name in names]))
    floats += [(name, quantized_weight([parts]).dequantize()) for name, parts in unpacked.items() if name not in placed]
    model.load_weights(floats)
