"""compressed-tensors int8 and fp8 checkpoints (llm-compressor's W8A8 and W8A16, the
"...-quantized.w8a8" models vLLM runs, and its FP8 / FP8_DYNAMIC schemes, the "...-FP8-dynamic"
ones), read into Octavo's int8 and fp8 formats without dequantizing.

The layout, as the compressed-tensors library writes it and vLLM reads it:
- config.json ``quantization_config`` (older llm-compressor versions: ``compression_config``, which
  ModelConfig reads as it): ``quant_method`` "compressed-tensors", ``format`` (the
  compressor), ``config_groups`` {name: {``targets``, ``weights``, ``input_activations``,
  ``output_activations``}} and ``ignore``. A group's targets are module names, "re:" regular
  expressions (matched from the start of the name) or module class names ("Linear"); each
  quantization args entry has ``num_bits``, ``type`` ("int" / "float"), ``symmetric``,
  ``strategy`` ("tensor", "channel", "group", "block", "token", ...; when absent it follows from
  ``group_size``: none -> tensor, -1 -> channel, > 0 -> group) and ``dynamic``.
- "int-quantized" and "naive-quantized" are one compressor under two names (so is
  "float-quantized", for fp8): each quantized Linear's ``weight`` is stored in the quantized
  type itself, int8 [N, K] for 8-bit integers, beside ``weight_scale`` in the layer's float
  dtype, [N, 1] per channel or [1] per tensor, and w = q * scale. Symmetric zero points are left
  out of the file; static activation scales would be ``input_scale``. Layers the ``ignore`` list
  names (the LM head, usually) are stored as plain float ``weight``s with no scale, so the
  tensors themselves say which layers are quantized.
- llm-compressor's symmetric int8 scale is max |w| / 127.5 with q clamped to [-128, 127]: the
  weights do reach -128.
- W8A8 ("int8" weights, "int8" dynamic per-token activations, vLLM's CompressedTensorsW8A8Int8)
  rounds each activation row to int8 at run time: format "int8_a8" here, which does the same
  (CPU only for now). Weights-only int8 (no ``input_activations``, W8A16) is format "int8", which
  multiplies float activations.
- FP8 ("float" 8-bit weights, float8_e4m3fn [N, K], per channel or per tensor; activations
  "float" dynamic per token or static per tensor with an ``input_scale``) is format "fp8" here,
  weight-only: the activations stay the model's dtype, so the ``input_scale`` is not used.

Refused with a message naming the field: other compressors ("pack-quantized" int4, sparse,
marlin), weights that are not 8-bit symmetric integers or floats per channel or per tensor
(asymmetric, group, block, 4-bit), int8 activations that are not dynamic per-token symmetric
(static ``input_scale``, per-tensor, asymmetric), output activations, KV cache schemes, sparse
formats (a ``sparsity_config`` of format "dense" is no sparsity) and transforms.

Sources: compressed-tensors' config/base.py (the formats), quantization/quant_args.py (the args and
their defaults), quantization/lifecycle/initialize.py (scale shapes and dtype),
quantization/utils/helpers.py (the scale), compressors/quantized_compressors/naive_quantized.py
and base.py (what is stored, zero points left out); vLLM's compressed_tensors.py (which args make
its dynamic per-token W8A8 int8) and compressed_tensors/utils.py (targets and ``ignore``).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch

from ..layers.linear import QuantizedWeight
from ..layers.quantize import place_quantized
from .fp8 import check_codes

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized", "float-quantized")
_NOT_READ = ("kv_cache_scheme", "transform_config")


def _strategy(args: dict) -> str:
    strategy = args.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    size = args.get("group_size")
    return "tensor" if size is None else "channel" if size == -1 else "group"


def _is_float(args: dict) -> bool:
    return str(args.get("type", "int")).lower() == "float"


def _check_int8(where: str, args: dict, strategies: tuple[str, ...], dynamic: bool, types=("int",)) -> None:
    """One quantization args entry: 8-bit symmetric numbers of ``types`` with one of ``strategies``."""
    if args.get("num_bits", 8) != 8:
        raise ValueError(f"compressed-tensors {where}.num_bits is {args.get('num_bits')}: Octavo reads 8-bit "
                         f"numbers only")
    if str(args.get("type", "int")).lower() not in types:
        raise ValueError(f"compressed-tensors {where}.type is {args.get('type')!r}: Octavo reads "
                         f"{' or '.join(map(repr, types))}")
    if not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors {where}.symmetric is false: asymmetric (zero-point) quantization "
                         f"is not supported, only symmetric")
    if dynamic is not None and args.get("dynamic", False) is not dynamic:
        raise ValueError(f"compressed-tensors {where}.dynamic is {args.get('dynamic', False)!r}: "
                         + ("static activation scales (input_scale) are not supported; Octavo rounds each "
                            "activation row with its own scale at run time (dynamic: true)" if dynamic else
                            "weights must carry static scales (dynamic: false)"))
    if _strategy(args) not in strategies:
        raise ValueError(f"compressed-tensors {where}.strategy is {_strategy(args)!r}: Octavo reads "
                         f"{' or '.join(map(repr, strategies))}")


def check_config(quant: dict) -> None:
    """ValueError naming the field, for anything but int8 weights per channel or per tensor with
    dynamic per-token int8 activations (W8A8) or float ones (W8A16), or fp8 weights per channel or
    per tensor with fp8 activations of any scheme or none (multiplied as floats)."""
    fmt = quant.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (Octavo reads "
                         f"{' and '.join(map(repr, FORMATS))}: int8 and fp8 weights)")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity_config format {sparsity.get('format')!r} is not supported "
                         f"(dense only)")
    for field in _NOT_READ:
        if quant.get(field):
            raise ValueError(f"compressed-tensors {field} is not supported (this checkpoint sets it)")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if group.get("format") not in (None, *FORMATS):
            raise ValueError(f"compressed-tensors {where}.format {group.get('format')!r} is not supported "
                             f"(Octavo reads {' and '.join(map(repr, FORMATS))})")
        if not group.get("weights"):
            raise ValueError(f"compressed-tensors {where} has no weights: activation-only quantization is not "
                             f"supported")
        _check_int8(f"{where}.weights", group["weights"], ("channel", "tensor"), dynamic=False, types=("int", "float"))
        if group.get("input_activations") and _is_float(group["weights"]):  # not used: weight-only fp8
            _check_int8(f"{where}.input_activations", group["input_activations"], ("token", "tensor"), dynamic=None,
                        types=("float",))
        elif group.get("input_activations"):
            _check_int8(f"{where}.input_activations", group["input_activations"], ("token",), dynamic=True)
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors {where}.output_activations is not supported")


def quantizes_activations(quant: dict) -> bool:
    """Whether a compressed-tensors config rounds activations to int8 (W8A8) anywhere."""
    return any(g.get("input_activations") and not _is_float(g.get("weights") or {})
               for g in (quant.get("config_groups") or {}).values())


def _matches(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def weight_format(layer: str, groups: dict) -> str:
    """"int8_a8", "int8" or "fp8": the format of quantized layer ``layer`` (an HF module name) by
    the config group whose targets name it, else the first that targets its class (Linear)."""
    by_name = [g for g in groups.values() if any(_matches(layer, t) for t in g.get("targets", ()))]
    by_class = [g for g in groups.values() if any(str(t).lower() == "linear" for t in g.get("targets", ()))]
    found = (by_name + by_class)[:1]
    if not found:
        raise ValueError(f"the checkpoint quantizes {layer}, which no compressed-tensors config_groups target "
                         f"names")
    if _is_float(found[0].get("weights") or {}):
        return "fp8"
    return "int8_a8" if found[0].get("input_activations") else "int8"


@dataclass
class Int8Rows:
    """A quantized Linear's q [N, K] (int8, or float8_e4m3fn for "fp8") and per-row float32 scales
    [N], w = q * scale."""

    q: torch.Tensor
    scales: torch.Tensor
    weight_format: str

    def cut(self, dim: int, begin: int, end: int) -> Int8Rows | None:
        """Outputs (dim 0) or inputs (dim 1) [begin, end): a tensor-parallel rank's part. An input
        cut keeps the whole rows' scales, and is None off multiples of 32 (the int8 row blocks)."""
        if dim == 0:
            return Int8Rows(self.q[begin:end], self.scales[begin:end], self.weight_format)
        if begin % 32 or end % 32:
            return None
        return Int8Rows(self.q[:, begin:end], self.scales, self.weight_format)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]


def read_layer(layer: str, tensors: dict[str, torch.Tensor], fmt: str) -> Int8Rows:
    q, scale = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
    dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
    if q.dtype != dtype or q.dim() != 2:
        raise ValueError(f"{layer}.weight is {q.dtype} {list(q.shape)} beside its weight_scale, expected "
                         f"{str(dtype).removeprefix('torch.')} [N, K] as its config group says (checkpoints whose "
                         f"quantized weights are stored in another dtype are not supported)")
    if fmt == "fp8":
        check_codes(f"{layer}.weight", q)
    n = q.shape[0]
    if scale.numel() == 1:
        scales = scale.float().reshape(1).expand(n)
    elif tuple(scale.shape) in ((n, 1), (n,)):
        scales = scale.float().reshape(n)
    else:
        raise ValueError(f"{layer}.weight_scale has shape {list(scale.shape)}, expected [{n}, 1] (per channel) "
                         f"or [1] (per tensor)")
    zero = tensors.get(f"{layer}.weight_zero_point")
    if zero is not None and bool(zero.ne(0).any()):
        raise ValueError(f"{layer}.weight_zero_point is not zero: asymmetric weights are not supported")
    return Int8Rows(q, scales.contiguous(), fmt)


def quantized_weight(parts: list[Int8Rows]) -> QuantizedWeight | None:
    """One weight from the parts of a fused projection (rows concatenated), or None when they
    differ in format or their rows are not whole blocks of 32 inputs (those load as floats)."""
    k = parts[0].q.shape[1]
    if k % 32 or any(p.weight_format != parts[0].weight_format for p in parts):
        return None
    q = torch.cat([p.q for p in parts]) if len(parts) > 1 else parts[0].q
    scales = torch.cat([p.scales for p in parts])
    if parts[0].weight_format == "fp8":  # one group of the whole row
        return QuantizedWeight(q, "fp8", k, scales=scales[:, None], group_size=k)
    return QuantizedWeight(q, parts[0].weight_format, k, scales=scales)


def load_compressed_tensors(model, tensors: dict[str, torch.Tensor], quant: dict) -> None:
    """Float tensors as they are; each quantized Linear's int8 weight placed as it is stored
    (place_quantized) wherever all parts of a fused weight agree, else dequantized into the float
    weight. Tensor parallel: each Linear's integers are cut to this rank's part
    (``model.shard_slices``); an input cut off the 32-input blocks loads as floats, which
    ``load_weights`` cuts."""
    check_config(quant)
    groups, slices = quant["config_groups"], model.shard_slices()
    whole, parts, floats = {}, {}, []
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            layer = name[: -len(".weight_scale")]
            if f"{layer}.weight" not in tensors:
                raise ValueError(f"the checkpoint has {name} but lacks {layer}.weight")
            weight = f"{layer}.weight"
            whole[weight] = read_layer(layer, tensors, weight_format(layer, groups))
            cut = slices.get(weight)
            part = whole[weight] if cut is None else whole[weight].cut(*cut[:3])
            if part is not None:
                parts[weight] = part
        elif name.endswith((".input_scale", ".input_zero_point")):
            layer = name.rsplit(".", 1)[0]
            if weight_format(layer, groups) != "fp8":  # fp8's activations stay floats: not used
                raise ValueError(f"the checkpoint has {name}: static activation scales are not supported")
        elif tensor.dtype in (torch.int8, torch.float8_e4m3fn) and f"{name}_scale" not in tensors:
            raise ValueError(f"the checkpoint has {str(tensor.dtype).removeprefix('torch.')} {name} but no "
                             f"{name}_scale")
        elif not (name.endswith(".weight_zero_point") or f"{name}_scale" in tensors):
            floats.append((name, tensor))
    shapes = {name: tuple(p.q.shape) for name, p in parts.items()}
    placed = place_quantized(model, shapes, lambda names: quantized_weight([parts[name] for name in names]))
    dequantized = ((name, rows.dequantize()) for name, rows in whole.items() if name not in placed)
    model.load_weights(itertools.chain(floats, dequantized))
