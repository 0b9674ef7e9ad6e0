"""Load-time quantization (round to nearest) into the formats ``linear`` reads directly.

- "int8": one float32 scale per output row, symmetric: q = round(w / s), s = max |w| / 127.
- "int4": per row and group of ``group_size`` inputs, asymmetric with a zero point:
  q = round(w / s) + z in [0, 15], s = (max - min) / 15, z = round(-min / s). The group size is
  128 where it divides the row, else the largest multiple of 32 below it that does (the default
  model's 576-wide rows use 96).

``quantize_model`` quantizes a model's projections (fused QKV, output, gate_up, down) in the
chosen format and its LM head in int8: on a CPU decode step reads every weight once, and the
LM head of a small model is a fifth of its weights.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from .linear import QuantizedWeight

METHODS = ("int8", "int4")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales[scales == 0] = 1.0  # an all-zero row: any scale gives q = 0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q, "int8", w.shape[1], scales=scales)


def int4_group_size(in_features: int, wanted: int = 128) -> int:
    for g in range(wanted - wanted % 32, 31, -32):
        if in_features % g == 0:
            return g
    raise ValueError(f"int4 needs rows whose length is a multiple of 32, got {in_features}")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> [N, K / 2]: in each 32, byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    halves = q.view(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    n, k = w.shape
    g = int4_group_size(k, group_size)
    groups = w.float().reshape(n, k // g, g)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / 15
    scales[scales == 0] = 1.0
    zeros = torch.round(-low / scales).clamp_(0, 15)
    q = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_nibbles(q.reshape(n, k)), "int4", k, scales=scales, zeros=zeros.to(torch.uint8),
                           group_size=g)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w)
    raise ValueError(f"unsupported quantization method {method!r} (supported: {', '.join(METHODS)})")


def input_columns(w: QuantizedWeight, begin: int, end: int) -> QuantizedWeight | None:
    """Inputs [begin, end) of an int8 / int4 weight (a row-parallel rank's part), with the
    whole rows' scales, so that the part is bit for bit the whole weight's; None where the cut
    does not fall on the format's group boundaries."""
    if w.weight_format == "int8" and begin % 32 == 0 and end % 32 == 0:
        return QuantizedWeight(w.qweight[:, begin:end], "int8", end - begin, scales=w.scales)
    g = w.group_size
    if w.weight_format == "int4" and begin % g == 0 and end % g == 0 and begin % 32 == 0 and end % 32 == 0:
        return QuantizedWeight(w.qweight[:, begin // 2:end // 2], "int4", end - begin, scales=w.scales[:, begin // g:end // g],
                               zeros=w.zeros[:, begin // g:end // g], group_size=g)
    return None


def replace_weight(module: torch.nn.Module, name: str, weight: QuantizedWeight) -> None:
    """Puts ``weight`` where the parameter ``name`` of ``module`` was."""
    module._parameters.pop(name, None)
    setattr(module, name, weight)


def check_shapes(targets: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint tensors' shapes against the rows of ``model.weight_targets()`` they fill,
    with load_weights' message."""
    for name, shape in shapes.items():
        param, _, rows = targets[name]
        if tuple(shape) != (rows, param.shape[1]):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, "
                             f"expected {(rows, param.shape[1])} from config.json")


def place_quantized(model: torch.nn.Module, shapes: dict[str, tuple[int, int]],
                    make: Callable[[list[str]], QuantizedWeight | None]) -> set[str]:
    """Puts a quantized checkpoint's weights in place before any float is loaded, so that the
    float parameters they replace are never filled: a quantized model never takes its float size
    in memory, even for a moment.

    ``shapes``: the [N, K] of each quantized checkpoint tensor, checked against the rows it stands
    for as ``load_weights`` checks floats. For every matmul weight whose stacked tensors
    (``model.matmul_weights()``) are all quantized, ``make(names)`` builds the one weight, or
    gives None where the parts cannot share one (those are then loaded as floats). Returns the
    names whose data now lives only in quantized weights (a tied embedding stays a float table)."""
    targets = model.weight_targets()
    placed = set()
    for module, attr, names in model.matmul_weights():
        if not all(name in shapes for name in names):
            continue
        check_shapes(targets, {name: shapes[name] for name in names})
        weight = make(names)
        if weight is not None:
            replace_weight(module, attr, weight)
            placed.update(names)
    floats = {name for name, (param, _, _) in model.weight_targets().items() if not isinstance(param, QuantizedWeight)}
    return placed - floats


def _check_method(model: torch.nn.Module, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unsupported quantization method {method!r} (supported: {', '.join(METHODS)})")
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ValueError(f"quantization={method!r} needs float weights, but this model's are quantized already "
                         f"(a GGUF file or a GPTQ / AWQ / octavo checkpoint)")


def _quantize_weight(attr: str, weight: torch.Tensor, method: str) -> QuantizedWeight:
    return quantize_int8(weight) if attr == "lm_head" else quantize(weight, method)


def quantize_model(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """Quantizes ``model``'s float matmul weights in place (see the module docstring)."""
    _check_method(model, method)
    for module, attr, _ in model.matmul_weights():
        replace_weight(module, attr, _quantize_weight(attr, module._parameters[attr].data, method))
    return model


def load_quantizing(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], method: str) -> None:
    """``model.load_weights(weights)`` and ``quantize_model(model, method)`` in one pass: each
    matmul weight is quantized as soon as the checkpoint has given all its parts, and its float
    parameter is never filled, so loading holds one projection in floats at a time instead of the
    whole float model. The weights are those quantize_model makes: the parts are cast to the
    model's dtype first, as the parameters would hold them."""
    _check_method(model, method)
    targets = model.weight_targets()
    slices = model.shard_slices()  # tensor parallel: the part of each tensor this rank holds
    group_of = {name: (module, attr, names) for module, attr, names in model.matmul_weights() for name in names}
    # A tied LM head's part is the embedding, which also stays a float table for lookups.
    embedding = getattr(model, "embed_tokens", None)
    also_float = {name for name, (param, _, _) in targets.items() if param is embedding}
    pending: dict[str, torch.Tensor] = {}

    def floats() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name not in group_of or name in also_float:
                yield name, tensor
            if name not in group_of:
                continue
            module, attr, names = group_of[name]
            pending[name] = tensor
            if all(part in pending for part in names):
                parts = [pending.pop(part) for part in names]
                replace_weight(module, attr, _quantize_part(targets, slices, names, parts, attr, model.dtype, method))
        yield from list(pending.items())  # parts of a weight the checkpoint lacks some of: load_weights names those

    model.load_weights(floats())


def _quantize_part(targets: dict, slices: dict, names: list[str], parts: list[torch.Tensor], attr: str,
                   dtype: torch.dtype, method: str) -> QuantizedWeight:
    """The quantized weight of a fused projection's checkpoint tensors, as this rank holds it.
    Output rows are cut before quantizing (each row quantizes alone); input columns after, from
    the whole rows' quantization, so that a rank's part is bit for bit the whole weight's."""
    cuts = [slices.get(name) for name in names]
    parts = [t.narrow(0, c[1], c[2] - c[1]) if c and c[0] == 0 else t for t, c in zip(parts, cuts)]
    columns = next((c for c in cuts if c and c[0] == 1), None)
    if columns is not None:
        wrong = [(n, tuple(t.shape)) for n, t in zip(names, parts) if t.shape[1] != columns[3]]
        if wrong:
            raise ValueError(f"checkpoint tensor {wrong[0][0]!r} has shape {wrong[0][1]}, expected "
                             f"{columns[3]} columns from config.json")
    check_shapes(targets, {n: (t.shape[0], columns[2] - columns[1]) if columns else tuple(t.shape)
                           for n, t in zip(names, parts)})
    whole = torch.cat([t.to(dtype) for t in parts]) if len(parts) > 1 else parts[0].to(dtype)
    weight = _quantize_weight(attr, whole, method)
    if columns is None:
        return weight
    begin, end = columns[1], columns[2]
    return input_columns(weight, begin, end) or _quantize_weight(attr, whole[:, begin:end], method)


# ---- Octavo's quantized checkpoints (octavo quantize) ----------------------------------------
# A directory like the source's (config.json, tokenizer and generation files) whose config.json
# gains quantization_config {"quant_method": "octavo", "format": METHOD}, and whose
# model.safetensors holds the quantized model's state_dict: float parameters under their module
# names and, per quantized projection, "<name>.qweight" / ".scales" / ".zeros" buffers; the
# config's "layouts" give each projection's format, group size and input count. Loading puts
# empty QuantizedWeights of the saved shapes where the projections are, then loads it.

QUANT_METHOD = "octavo"


def quantized_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(tensors to save, {projection name: its format and group size})."""
    layouts = {name: {"format": m.weight_format, "group_size": m.group_size, "in_features": m.in_features}
               for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    return {k: v.contiguous() for k, v in model.state_dict().items()}, layouts


def load_quantized_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], layouts: dict[str, dict]) -> None:
    for name, layout in layouts.items():
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)

        def saved(part: str) -> torch.Tensor | None:
            return tensors.get(f"{name}.{part}")

        if saved("qweight") is None:
            raise ValueError(f"the checkpoint's quantization_config lists {name} but it has no {name}.qweight")

        replace_weight(module, attr, QuantizedWeight(torch.empty_like(saved("qweight")), layout["format"],
                                                     layout["in_features"], saved("scales"), saved("zeros"),
                                                     layout["group_size"]))
    model.load_state_dict(tensors, strict=True)
