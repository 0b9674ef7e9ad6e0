"""Load-time quantization (round to nearest) into the formats ``linear`` reads directly.

- "int8": one float32 scale per output row, symmetric: q = round(w / s), s = max |w| / 127.
- "int4": per row and group of ``group_size`` inputs, asymmetric with a zero point:
  q = round(w / s) + z in [0, 15], s = (max - min) / 15, z = round(-min / s). The group size is
  128 where it divides the row, else the largest multiple of 32 below it that does (the default
  model's 576-wide rows use 96).
- "w4a8": int4's weights (format "int4_a8"), but on the CPU ``linear`` rounds each input row to
  int8 with one scale per weight group and multiplies integers (vLLM's W4A8, with llama.cpp's kind
  of activation blocks): about half the arithmetic of int4's float path at decode, at an accuracy
  cost lost in int4's own (bench/RESULTS.md). CPU only; prefill-sized bfloat16 batches still
  multiply dequantized weights where the CPU lacks AMX.
- "q4_1": llama.cpp's Q4_1 blocks (format "q4_1", as a GGUF file holds them): per row and
  group of 32 inputs, w = d * q + m with q in [0, 15], d = (max - min) / 15 and m = min in
  float16. The float minimum fits a grid that int4's integer zero point cannot: a model whose
  weights came from a Q4_1 file gets them back exactly.
- "w8a8": int8's weights (format "int8_a8"), and ``linear`` rounds each input row to int8 with
  one scale for the whole row (dynamic per token) and multiplies integers, one scaling per output
  (vLLM's W8A8 int8, as compressed-tensors checkpoints hold it: loader/compressed_tensors.py). On
  AMX int8 tiles that is the fastest prefill of any format here. CPU only.
- "fp8": E4M3 weights (format "fp8") with one float32 scale per output row: q = w / s rounded
  to the nearest E4M3 value, s = max |w| / 448, the format FP8 checkpoints hold (loader/fp8.py
  reads theirs as they are). Weight-only: the activations stay in the model's dtype; CPU and CUDA.

- "gguf_a8": no weights change; a GGUF file's quantized weights (its blocks, as loaded) are
  multiplied by inputs rounded to int8 per block of 32 (llama.cpp's Q8_0 activations, as llama.cpp
  multiplies them on the CPU): ``linear`` at one row runs 1.5-1.8x the float path's speed, with the
  inputs' rounding as the accuracy cost, but from about 64 rows (batched decode, prefill) slower
  than the float path (bench/RESULTS.md). CPU only.

``quantize_model`` quantizes a model's projections (fused QKV, output, gate_up, down) in the
chosen format and its LM head in int8: on a CPU decode step reads every weight once, and the
LM head of a small model is a fifth of its weights.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from .linear import FP8_MAX, QuantizedWeight

METHODS = ("int8", "int4", "q4_1", "w4a8", "w8a8", "fp8")
GGUF_A8 = "gguf_a8"  # not a weight format: int8 inputs for the blocks a GGUF file holds
GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q3_k", "q4_k", "q5_k", "q6_k")
INT4_FORMATS = ("int4", "int4_a8")  # the same stored weights
INT8_FORMATS = ("int8", "int8_a8")


def quantize_int8(w: torch.Tensor, weight_format: str = "int8") -> QuantizedWeight:
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales[scales == 0] = 1.0  # an all-zero row: any scale gives q = 0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q, weight_format, w.shape[1], scales=scales)


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """E4M3 weights with one float32 scale per output row (per channel: vLLM's quantization="fp8"
    takes one per tensor, which a row's scale can only match or beat): q = w / s rounded to the
    nearest E4M3 value, s = the row's largest |w| / 448."""
    w = w.float()
    scales = w.abs().amax(dim=1) / FP8_MAX
    scales[scales == 0] = 1.0  # an all-zero row: any scale gives q = 0
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(q, "fp8", w.shape[1], scales=scales[:, None], group_size=w.shape[1])


def fp8_input_columns(q: torch.Tensor, scales: torch.Tensor, g: int, begin: int, end: int):
    """Inputs [begin, end) of an fp8 weight's parts (q [N, K], scales [N, K / g], g), or None off
    the 32-input blocks or inside a group of scales. One scale per row keeps every cut."""
    if begin % 32 or end % 32:
        return None
    if scales.shape[1] == 1:
        return q[:, begin:end], scales, end - begin
    if begin % g or end % g:
        return None
    return q[:, begin:end], scales[:, begin // g:end // g], g


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


def quantize_int4(w: torch.Tensor, group_size: int = 128, weight_format: str = "int4") -> QuantizedWeight:
    n, k = w.shape
    g = int4_group_size(k, group_size)
    groups = w.float().reshape(n, k // g, g)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / 15
    scales[scales == 0] = 1.0
    zeros = torch.round(-low / scales).clamp_(0, 15)
    q = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_nibbles(q.reshape(n, k)), weight_format, k, scales=scales,
                           zeros=zeros.to(torch.uint8), group_size=g)


def quantize_q4_1(w: torch.Tensor) -> QuantizedWeight:
    """GGUF Q4_1 blocks of 20 bytes per 32 inputs (float16 d, float16 m, 16 bytes of nibbles), as
    llama.cpp's reference quantizer writes them: q = floor((w - min) / d + 0.5)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"q4_1 needs rows whose length is a multiple of 32, got {k}")
    groups = w.float().reshape(n, k // 32, 32)
    low = groups.amin(dim=-1)
    d = (groups.amax(dim=-1) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.floor((groups - low[..., None]) * inverse[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
    halves = [t.half().view(torch.uint8).view(n, k // 32, 2) for t in (d, low)]
    blocks = torch.cat([*halves, pack_nibbles(q.reshape(n, k)).view(n, k // 32, 16)], dim=-1)
    return QuantizedWeight(blocks.reshape(n, k // 32 * 20), "q4_1", k)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w)
    if method == "q4_1":
        return quantize_q4_1(w)
    if method == "w4a8":
        return quantize_int4(w, weight_format="int4_a8")
    if method == "w8a8":
        return quantize_int8(w, weight_format="int8_a8")
    if method == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"unsupported quantization method {method!r} (supported: {', '.join(METHODS)})")


def input_columns(w: QuantizedWeight, begin: int, end: int) -> QuantizedWeight | None:
    """Inputs [begin, end) of an int8 / int4 / q4_1 weight (a row-parallel rank's part), with the
    whole rows' scales, so that the part is bit for bit the whole weight's; None where the cut
    does not fall on the format's group boundaries."""
    if w.weight_format in INT8_FORMATS and begin % 32 == 0 and end % 32 == 0:
        return QuantizedWeight(w.qweight[:, begin:end], w.weight_format, end - begin, scales=w.scales)
    g = w.group_size
    if w.weight_format in INT4_FORMATS and begin % g == 0 and end % g == 0 and begin % 32 == 0 and end % 32 == 0:
        return QuantizedWeight(w.qweight[:, begin // 2:end // 2], w.weight_format, end - begin,
                               scales=w.scales[:, begin // g:end // g], zeros=w.zeros[:, begin // g:end // g],
                               group_size=g)
    if w.weight_format == "fp8":
        part = fp8_input_columns(w.qweight, w.scales, g, begin, end)
        if part is None:
            return None
        return QuantizedWeight(part[0], "fp8", end - begin, scales=part[1], group_size=part[2])
    if w.weight_format == "q4_1" and begin % 32 == 0 and end % 32 == 0:  # the one GGUF format saved here
        return QuantizedWeight(w.qweight[:, begin // 32 * 20:end // 32 * 20], "q4_1", end - begin)
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
    gives None where the parts cannot share one (those are then loaded as floats, as are weights
    with an input order where the module has ``takes_input_order = False``). Returns the
    names whose data now lives only in quantized weights (a tied embedding stays a float table)."""
    targets = model.weight_targets()
    placed = set()
    for module, attr, names in model.matmul_weights():
        if not all(name in shapes for name in names):
            continue
        check_shapes(targets, {name: shapes[name] for name in names})
        weight = make(names)
        # fused_moe has no place for a permutation of the inputs (act-order GPTQ): such experts
        # load as floats.
        if weight is not None and weight.input_order is not None and not getattr(module, "takes_input_order", True):
            weight = None
        if weight is not None:
            replace_weight(module, attr, weight)
            placed.update(names)
    floats = {name for name, (param, _, _) in model.weight_targets().items() if not isinstance(param, QuantizedWeight)}
    return placed - floats


def _check_method(model: torch.nn.Module, method: str) -> None:
    if method == GGUF_A8:
        raise ValueError(f"quantization={GGUF_A8!r} multiplies a GGUF file's quantized weights by int8 inputs, but "
                         f"this model's weights are floats: load a .gguf file with quantized tensors, or pick a "
                         f"weight quantization ({', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"unsupported quantization method {method!r} (supported: {', '.join(METHODS)})")
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ValueError(f"quantization={method!r} needs float weights, but this model's are quantized already "
                         f"(a GGUF file or a GPTQ / AWQ / octavo checkpoint)")


def _quantize_weight(attr: str, weight: torch.Tensor, method: str) -> QuantizedWeight:
    return quantize_int8(weight) if attr == "lm_head" else quantize(weight, method)


def quantize_model(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """Quantizes ``model``'s float matmul weights in place (see the module docstring)."""
    if method == GGUF_A8 and _gguf_blocks(model):
        return multiply_int8_inputs(model)
    _check_method(model, method)
    for module, attr, _ in model.matmul_weights():
        replace_weight(module, attr, _quantize_weight(attr, module._parameters[attr].data, method))
    return model


def _gguf_blocks(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The model's weights kept in GGUF blocks (a mixed-format weight's parts, each in its own)."""
    return [m for m in model.modules() if isinstance(m, QuantizedWeight) and m.weight_format in GGUF_FORMATS]


def multiply_int8_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """quantization "gguf_a8": every weight in GGUF blocks multiplies int8-rounded inputs from now
    on (the embedding table's lookups still decode rows; mixture-of-experts stacks keep float
    inputs). Float weights of the file (F32 / F16 tensors) are not touched."""
    for weight in _gguf_blocks(model):
        weight.int8_inputs = True
        weight._bind()
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


# The tensors a saved quantized weight has, by format.
_SAVED_PARTS = {"int8": ("qweight", "scales"), "int8_a8": ("qweight", "scales"),
                "int4": ("qweight", "scales", "zeros"), "int4_a8": ("qweight", "scales", "zeros"),
                "q4_1": ("qweight",), "fp8": ("qweight", "scales")}


def _whole_name(model: torch.nn.Module, local: str) -> str:
    """A pipeline stage's parameter name -> the whole model's (its layers are numbered from the
    stage's first layer)."""
    if local.startswith("layers."):
        _, index, rest = local.split(".", 2)
        return f"layers.{int(index) + model.first_layer}.{rest}"
    return local


def _rank_cuts(model: torch.nn.Module) -> dict[int, tuple]:
    """id(parameter) -> ("rows", the whole parameter's rows this rank holds) or ("columns", begin,
    end), for the fused parameters tensor parallelism cuts (``model.shard_slices`` names the cut of
    each checkpoint tensor; a fused parameter stacks its tensors' rows in ``weight_targets`` order),
    and for those a module's ``held_rows()`` names (expert parallel: this rank's experts' rows of
    the whole model's expert stacks)."""
    slices, parts = model.shard_slices(), {}
    for name, (param, start, rows) in model.weight_targets().items():
        parts.setdefault(id(param), []).append((start, rows, slices.get(name)))
    cuts = {}
    for key, stacked in parts.items():
        rows, offset = [], 0
        for _, local_rows, cut in sorted(stacked, key=lambda part: part[0]):
            if cut is not None and cut[0] == 1:
                cuts[key] = ("columns", cut[1], cut[2])
                break
            begin, end, whole = (cut[1], cut[2], cut[3]) if cut is not None else (0, local_rows, local_rows)
            rows.append(torch.arange(offset + begin, offset + end))
            offset += whole
        else:
            if any(cut is not None for *_, cut in stacked):
                cuts[key] = ("rows", torch.cat(rows))
    for module in model.modules():  # parts whose rows are a rank's share of a whole stack (experts)
        for attr, rows in getattr(module, "held_rows", dict)().items():
            cuts[id(module._parameters[attr])] = ("rows", rows)
    return cuts


def _cut_quantized(whole: QuantizedWeight, cut: tuple | None) -> QuantizedWeight | torch.Tensor:
    """This rank's part of a saved quantized weight: rows as they are; input columns on the
    format's boundaries (``input_columns``), else dequantized floats."""
    if cut is None:
        return whole
    if cut[0] == "rows":
        rows = cut[1]
        return QuantizedWeight(whole.qweight[rows], whole.weight_format, whole.in_features,
                               None if whole.scales is None else whole.scales[rows],
                               None if whole.zeros is None else whole.zeros[rows], whole.group_size)
    return input_columns(whole, cut[1], cut[2]) or whole.dequantize()[:, cut[1]:cut[2]]


def load_quantized_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], layouts: dict[str, dict]) -> None:
    """Fills ``model`` from an ``octavo quantize`` checkpoint, whose tensors are the whole
    quantized model's state: a tensor-parallel rank takes its rows or input columns of each
    (an input cut off the format's boundaries dequantizes that part into floats), a pipeline
    stage its layers (renumbered) and no placeholder's."""
    cuts, used, filled = _rank_cuts(model), set(), set()
    names = {id(module): name for name, module in model.named_modules()}

    def saved(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks tensor {name!r}")
        used.add(name)
        return tensors[name]

    for module, attr, _ in model.matmul_weights():
        local = f"{names[id(module)]}.{attr}".lstrip(".")
        param, whole_name = module._parameters[attr], _whole_name(model, local)
        if whole_name not in layouts or not param.shape[0] or (attr == "lm_head" and not model.stage.is_last):
            continue  # a float weight, a stage's empty placeholder, or a tied LM head a stage does not use
        layout = layouts[whole_name]
        if layout.get("format") not in _SAVED_PARTS:
            raise ValueError(f"the checkpoint's layout of {whole_name} has format {layout.get('format')!r}, "
                             f"not one of {', '.join(_SAVED_PARTS)}")
        parts = {part: saved(f"{whole_name}.{part}") for part in _SAVED_PARTS[layout["format"]]}
        whole = QuantizedWeight(parts["qweight"], layout["format"], layout["in_features"], parts.get("scales"),
                                parts.get("zeros"), layout["group_size"])
        part = _cut_quantized(whole, cuts.get(id(param)))
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint weight {whole_name!r} is {tuple(whole.shape)}, which does not fit "
                             f"{tuple(param.shape)} here")
        if isinstance(part, QuantizedWeight):
            replace_weight(module, attr, part)
        else:
            param.data.copy_(part)
            filled.add(id(param))
    for local, param in model.named_parameters():
        if not param.shape[0] or id(param) in filled:
            continue
        tensor, cut = saved(_whole_name(model, local)), cuts.get(id(param))
        if cut is not None:
            tensor = tensor[cut[1]] if cut[0] == "rows" else tensor[:, cut[1]:cut[2]]
        if tensor.shape != param.shape:
            raise ValueError(f"checkpoint tensor {_whole_name(model, local)!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
    unused = sorted(set(tensors) - used)
    if unused and model.stage.world == 1:
        raise ValueError(f"checkpoint tensors not used by the model: {', '.join(unused[:5])}")
