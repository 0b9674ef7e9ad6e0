"""Dense projections: Octavo's ``linear`` kernel where it beats torch, torch's GEMM elsewhere.

The crossover is measured on the machine the engine runs on (``layers/crossover.py``: at model
load, cached per CPU), because it differs between CPUs: on an Intel Xeon with AMX, torch's MKL
float32 GEMM overtakes Octavo's kernel at about 512 rows (from 16 rows Octavo's float32 runs on
transposed weight panels: 1.1-1.9x MKL at 64 rows), while Octavo's bfloat16 kernel runs on AMX
tiles from 8 rows (``amx`` kernel level): 1.4-3x torch's oneDNN GEMM at 16-64 rows, about even
summed over the model's shapes at 1024 (bench/RESULTS.md), so the probe picks it at every M.
The built-in table below (``OCTAVO_LINEAR_CROSSOVER=builtin``, and the tests) is what the
development machine measured (AMD EPYC, AVX-512 with BF16, 2 threads, torch 2.13 CPU) at the
default model's shapes (960x576, 3072x576, 576x1536, 49152x576), rows = M:
- float32: Octavo's kernel is faster at every M from 1 to 8192 (M = 1: 2-3x; prefill M = 512
  to 8192: 1.4-2x; torch's MKL float32 GEMM is slow on this AMD CPU), so it is used at every M.
  (Up to M = 8192 since the kernel takes input rows in L2-sized chunks; before that, M = 8192 ran
  2.5-4x slower per row than M = 2048 and lost to torch.) At Llama-3-8B's down projection
  (1024x14336, a slice of it) torch catches up at M = 256 (0.96x); 2.2x at M = 1.
- float16: torch's CPU float16 GEMM is 3-6x slower at every M: always Octavo's kernel.
- bfloat16: Octavo's kernel (vdpbf16ps) wins up to M = 16 (M = 1: 1.3-5x); from M = 32
  torch's oneDNN GEMM (packed, larger register blocks) is faster.
Octavo's kernel computes each output row the same way for every M on each side of its one switch
(float32 on vector levels: below 16 rows and from 16 on; bfloat16 on the amx level: below 8 and
from 8 on), so decode batches of any size on one side give bit-identical rows.

Where the kernel level is ``amx`` and torch never wins for bfloat16, the engine repacks bfloat16
weights once at load into AMX weight tiles (``layers/bf16_tiles.py``, a ``QuantizedWeight`` in
format "bf16_tiles"), which the tile kernel then reads without transposing them on every call.

Quantized weights (``QuantizedWeight``: GGUF blocks, int8, int4) go through Octavo's kernel on
the CPU at every M; no torch kernel reads those formats. Against torch on the dequantized float32
weights it is 12-18x faster at M = 1 and 1.3-2.5x from M = 64 to 8192: from 8 rows on, the kernel
decodes each weight tile (from 16 rows: each weight panel) once and runs the float32 path over it,
so every format computes at float32's speed for prefill (bench/RESULTS.md).

On a GPU, dense weights take Octavo's CUDA kernel up to ``CUDA_DENSE_KERNEL_MAX_ROWS`` rows, where
it reads the weight faster than cuBLAS does (bench/python/bench_cuda.py's dense table), and cuBLAS
above. Quantized weights take Octavo's CUDA kernel (a GEMV that decodes in registers) up to
``CUDA_KERNEL_MAX_ROWS`` rows, and above it cuBLAS on the weights dequantized to the activations'
dtype, a slab of rows at a time. The kernel's time grows with M (it reads the weight once per 4
rows and decodes it each time), the dequantizing path's hardly does; on an H200 they meet near
M = 8 for int4 and Q4_0 (bench_cuda.py's table, bench/RESULTS.md). Either side of it a row's bits
differ: the kernel multiplies the float32 weights, the GEMM
them rounded to the activations' dtype, as a bfloat16 checkpoint's weights would be. On a GPU
rows are not batch-invariant anyway (cuBLAS picks its algorithm by shape).

A third CUDA path waits for its measurement: ``tensor_cores=True`` runs linear_mma.cu's kernel
(bfloat16 / float16 activations), which decodes each weight once per 16 rows into tensor-core
fragments (Marlin's design), so its time should stay near the M = 1 time up to 16 rows. It
multiplies the weights rounded to the activations' dtype, as the GEMM path does. Quantized
products of up to ``CUDA_TENSOR_CORE_MAX_ROWS`` rows take it; 0 until bench_cuda.py's table shows
where it wins.

FP8 weights with one scale per output row can also run W8A8 on a Hopper GPU, as vLLM runs FP8
checkpoints there: ``fp8_gemm`` rounds each input row to E4M3 with a scale of its own and
multiplies on the FP8 tensor cores (torch._scaled_mm). Products of bfloat16 rows from
``CUDA_FP8_GEMM_FROM_ROWS`` rows on would take it; inf, none, until measured on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _C

# The smallest row count at which torch's GEMM takes over, per dtype: the built-in table, which
# crossover.calibrate() replaces with this machine's measurement when a CPU model loads.
TORCH_FROM_ROWS = {torch.float32: math.inf, torch.float16: math.inf, torch.bfloat16: 32}
# On CUDA, the most rows a quantized weight's product runs in Octavo's kernel (see above), and the
# weights dequantized at a time above it (64 MiB in 16 bits: a slab, not the LM head whole).
CUDA_KERNEL_MAX_ROWS = 8
# On CUDA, the most rows a dense weight's product runs in Octavo's kernel, per dtype: where it
# beat cuBLAS on Llama-3-8B's projections (H200, bench_cuda.py's dense table: 16-bit M = 1 only;
# float32 takes the quantized formats' kernel, even with cuBLAS at M = 1 and ahead to M = 8).
CUDA_DENSE_KERNEL_MAX_ROWS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}
DEQUANTIZE_SLAB_WEIGHTS = 1 << 25
# On CUDA, the most rows of 16-bit activations a quantized weight's product runs on tensor cores
# (see above): 0, none, until a GPU measures where it wins.
CUDA_TENSOR_CORE_MAX_ROWS = 0
# On CUDA, the fewest rows of bfloat16 activations whose product with an fp8 weight of one scale
# per row runs W8A8 on FP8 tensor cores (fp8_gemm): inf, never, until a GPU measures where it wins.
CUDA_FP8_GEMM_FROM_ROWS = math.inf
FP8_MAX = 448.0  # E4M3's largest finite value
# On the CPU, 16-bit activations of a quantized product with fewer rows than this are multiplied
# as float32 (see linear); from 16 rows float32 runs on other kernels than 16-bit inputs do.
FLOAT_INPUT_MAX_ROWS = 16
# On the CPU, bfloat16 activations of a quantized product with at least this many rows go to
# torch's bfloat16 GEMM on the weights dequantized to bfloat16 (oneDNN, AMX tiles where the CPU
# has them), as on CUDA: int4 6144x2048 on an AMX Xeon, 2 threads, 1024 rows 130 -> 17 ms, 128
# rows 17 -> 7 ms, even at 32 (bench/RESULTS.md, MoE section). Rows then multiply the weights
# rounded to bfloat16, as a bfloat16 checkpoint's would be. Not where the CPU has AMX for int4_a8
# and int8_a8, whose int8 tiles beat that GEMM at every row count (6144x2048 at 512 rows: 5.1 ms against the
# bfloat16 GEMM's 5.6 on weights already dequantized) and keep the int8 inputs' arithmetic, nor
# for int8 from INT8_BF16_TILES_FROM_ROWS.
CPU_BF16_GEMM_FROM_ROWS = 64
# Where the CPU has AMX, int8 weights with bfloat16 activations from this many rows run on bf16
# tiles (csrc/kernels/cpu/linear_int8_bf16_tiles.h: kFromRows), 3-5x the vector kernel from 8
# rows, 6x the GEMM on dequantized weights at 64, and still faster than that GEMM alone at 512
# (14336x4096: 36.6 ms against 40-42 without the dequantizing): the inputs stay bfloat16.
INT8_BF16_TILES_FROM_ROWS = 4
# The formats whose CPU kernels round the activations to int8 (W4A8, W8A8).
INT8_INPUT_FORMATS = ("int4_a8", "int8_a8")


def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialized weight for a loader to fill (no gradients: inference only)."""
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedWeight(torch.nn.Module):
    """A projection weight in a quantized format that ``linear`` decodes as it reads: on the CPU in
    registers below 8 input rows, once per weight tile from 8 rows on; on CUDA in registers up to
    CUDA_KERNEL_MAX_ROWS rows, into dequantized slabs for torch's GEMM above.

    GGUF blocks as a file stores them ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl" in blocks
    of 32 weights, "q3_k", "q4_k", "q5_k", "q6_k" in super-blocks of 256: ``qweight`` uint8 [N,
    K / block weights * block bytes]), or Octavo's own load-time formats ("int8": ``qweight`` int8 [N, K] and
    ``scales`` [N]; "int4": ``qweight`` uint8 [N, K / 2], ``scales`` float32 and ``zeros`` uint8
    [N, K / group_size]; "int4_a8" / "int8_a8": int4's / int8's data, multiplied with int8-rounded
    inputs on the CPU; see ``octavo.layers.quantize``)."""

    def __init__(self, data: torch.Tensor, weight_format: str, in_features: int, scales: torch.Tensor | None = None,
                 zeros: torch.Tensor | None = None, group_size: int = 0, input_order: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", data.contiguous())
        self.register_buffer("scales", None if scales is None else scales.contiguous())
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous())
        # Act-order GPTQ: the stored inputs are the activations' columns in this order.
        self.register_buffer("input_order", input_order)
        self.weight_format, self.in_features, self.group_size = weight_format, in_features, group_size
        # GGUF blocks only: the CPU kernel rounds the inputs to int8 per block of 32 (quantization "gguf_a8").
        self.int8_inputs = False
        expected = in_features // _C.ops.weight_block_weights(weight_format) * _C.ops.weight_block_bytes(weight_format)
        if data.dim() != 2 or data.shape[1] != expected or data.element_size() != 1:
            raise ValueError(f"{weight_format} data for {in_features} inputs must be [N, {expected}] bytes, "
                             f"got {data.dtype} {list(data.shape)}")
        self._bind()

    def _bind(self) -> None:
        """What ``linear`` passes, read once into a plain attribute: a step calls ``linear`` about
        120 times, and each buffer read through nn.Module's attribute lookup costs time there."""
        self.bound = (self.qweight, self.weight_format, self.scales, self.zeros, self.group_size,
                      self.qweight.shape[0], self.input_order, self.int8_inputs)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # .to() and friends replace the buffers
        self._bind()
        return module

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def kernel_args(self) -> dict:
        return {"weight_format": self.weight_format, "scales": self.scales, "zeros": self.zeros,
                "group_size": self.group_size, "int8_inputs": self.int8_inputs}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weights the quantized data stands for (inputs in the activations' order), as
        float32 or rounded to ``dtype``, on the weight's device."""
        out = self.dequantize_rows(0, self.shape[0], dtype)
        if self.input_order is not None:
            out[:, self.input_order] = out.clone()
        return out

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the weights, inputs in the stored order (act-order GPTQ's
        permuted ones: the order ``linear`` multiplies in)."""
        out = torch.empty(stop - start, self.in_features, dtype=dtype, device=self.qweight.device)
        rows = slice(start, stop)
        scales, zeros = (None if t is None else t[rows] for t in (self.scales, self.zeros))
        _C.ops.dequantize(out, self.qweight[rows], self.weight_format, scales, zeros, self.group_size)
        return out

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"{self.weight_format}, shape={list(self.shape)}{group}"


class MixedWeight(QuantizedWeight):
    """A fused projection whose parts a file stores in different quantized formats (a Q4_K_M GGUF
    file's attn_q and attn_k in Q4_K beside attn_v in Q6_K): each part, a run of output rows,
    keeps its own blocks, and ``linear`` gives each part's outputs their columns of the result."""

    def __init__(self, parts: list[QuantizedWeight]):
        torch.nn.Module.__init__(self)
        if len({p.in_features for p in parts}) != 1 or any(p.input_order is not None for p in parts):
            raise ValueError("the parts of a mixed-format weight need the same inputs in the same order")
        self.parts = torch.nn.ModuleList(parts)
        self.weight_format = "+".join(p.weight_format for p in parts)
        self.in_features, self.group_size, self.input_order = parts[0].in_features, 0, None
        self.scales = self.zeros = None

    def _bind(self) -> None:
        pass

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.in_features

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        pieces, first = [], 0
        for part in self.parts:
            rows = part.shape[0]
            if start < first + rows and stop > first:
                pieces.append(part.dequantize_rows(max(start - first, 0), min(stop - first, rows), dtype))
            first += rows
        return torch.cat(pieces)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """On the CPU each part writes its columns of one output (no concatenation: the step's
        kernels alone, which a CPU op graph can record); elsewhere the parts' outputs are joined."""
        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype) if x.device.type == "cpu" else None
        outs, first = [], 0
        for part in self.parts:
            rows = part.shape[0]
            part_bias = None if bias is None else bias[first:first + rows]
            outs.append(linear(x, part, part_bias, None if out is None else out[:, first:first + rows]))
            first += rows
        return torch.cat(outs, dim=-1) if out is None else out

    def extra_repr(self) -> str:
        return f"{self.weight_format}, shape={list(self.shape)}"


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of an embedding table in ``dtype``. A quantized table (a GGUF file's token
    embedding, kept in its blocks) decodes only the rows it reads, so it never needs its float
    size in memory (Gemma 3 270M's 262144 x 640 table: 671 MB in float32, 170 MB in its Q8_0 blocks)."""
    if not isinstance(table, QuantizedWeight):
        return F.embedding(ids, table)
    index = ids.reshape(-1).long()
    scales, zeros = (None if t is None else t.index_select(0, index) for t in (table.scales, table.zeros))
    out = torch.empty(index.shape[0], table.in_features, dtype=dtype, device=table.device)
    _C.ops.dequantize(out, table.qweight.index_select(0, index), table.weight_format, scales, zeros, table.group_size)
    return out.view(*ids.shape, table.in_features)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] contiguous or quantized, bias [N] or None -> [M, N].
    out (a quantized weight's product only): an [M, N] tensor in x's dtype, rows contiguous, that
    receives the result and is returned."""
    if isinstance(weight, MixedWeight):
        return weight.linear(x, bias)
    if isinstance(weight, QuantizedWeight):
        qweight, weight_format, scales, zeros, group_size, n, input_order, int8_inputs = weight.bound
        cuda = x.device.type == "cuda"
        if cuda and x.shape[0] >= CUDA_FP8_GEMM_FROM_ROWS and fp8_gemm_takes(x, weight):
            return _into(out, fp8_gemm(x, weight, bias))
        if input_order is not None:
            x = x.index_select(-1, input_order)
        tensor_cores = cuda and x.dtype != torch.float32 and x.shape[0] <= CUDA_TENSOR_CORE_MAX_ROWS
        if cuda and x.shape[0] > CUDA_KERNEL_MAX_ROWS and not tensor_cores:
            return _into(out, _gemm_on_dequantized(x, weight, bias))
        dtype = x.dtype
        if x.device.type == "cpu" and dtype != torch.float32 and weight_format != "bf16_tiles":
            on_tiles = dtype == torch.bfloat16 and _on_amx_tiles(weight_format, x.shape[0])
            if dtype == torch.bfloat16 and x.shape[0] >= CPU_BF16_GEMM_FROM_ROWS and not on_tiles:
                return _into(out, _gemm_on_dequantized(x, weight, bias))
            rounded_to_int8 = weight_format in INT8_INPUT_FORMATS or int8_inputs
            if x.shape[0] < FLOAT_INPUT_MAX_ROWS and not rounded_to_int8 and not on_tiles:
                # The CPU kernel converts 16-bit inputs on every read; float32 ones it reads
                # directly (int4 at M = 1: about 1.3x as fast), and below FLOAT_INPUT_MAX_ROWS
                # either way it rounds the same float32 sums once: the same bits. (int4_a8,
                # int8_a8 and GGUF blocks with int8_inputs round their inputs to int8 whatever their
                # type; the int8 tiles multiply bfloat16 ones.)
                x, bias = x.float(), None if bias is None else bias.float()
        if out is not None and out.dtype == x.dtype:
            _C.ops.linear(out, x, qweight, bias, weight_format, scales, zeros, group_size, int8_inputs, tensor_cores)
            return out
        result = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        _C.ops.linear(result, x, qweight, bias, weight_format, scales, zeros, group_size, int8_inputs, tensor_cores)
        return _into(out, result.to(dtype))
    if not _dense_kernel_takes(x, weight):
        return F.linear(x, weight, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _C.ops.linear(out, x, weight, bias)
    return out


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """result, or out holding it."""
    return result if out is None else out.copy_(result)


def _on_amx_tiles(weight_format: str, rows: int) -> bool:
    """Whether the CPU kernel multiplies bfloat16 inputs of this quantized product on AMX tiles
    (int4_a8 and int8_a8 at every row count: int8 tiles from 4 rows, and their vector kernels
    below)."""
    if weight_format not in ("int8", *INT8_INPUT_FORMATS) or _C.cpu_isa() != "amx":
        return False
    return weight_format in INT8_INPUT_FORMATS or rows >= INT8_BF16_TILES_FROM_ROWS


def _dense_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether Octavo's kernel is the faster product of x and a dense weight (on CUDA it reads rows
    of 32 inputs, from input rows that start at 4-element boundaries)."""
    if x.device.type == "cpu":
        return x.shape[0] < TORCH_FROM_ROWS.get(x.dtype, 0)
    return (x.device.type == "cuda" and x.shape[0] <= CUDA_DENSE_KERNEL_MAX_ROWS.get(x.dtype, 0)
            and weight.shape[1] % 32 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % (4 * x.element_size()) == 0)


def fp8_gemm_takes(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether fp8_gemm multiplies x by weight: bfloat16 rows, an fp8 weight with one scale per
    output row (per-channel or per-tensor checkpoints; block-wise scales are not rows'), and in and
    out features in whole 16s (torch._scaled_mm's)."""
    n, k = weight.shape
    return (x.dtype == torch.bfloat16 and weight.weight_format == "fp8" and weight.scales.shape[1] == 1
            and n % 16 == 0 and k % 16 == 0)


def fp8_gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8: each row of x (bfloat16) rounded to E4M3 with its own scale s = max |x| / 448 (vLLM's
    dynamic per-token scale; at least float32's smallest normal, so a row of zeros stays zeros),
    times the E4M3 weight on FP8 tensor cores, the float32 sums scaled by both rows' scales ->
    [M, N] bfloat16."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # past 448 the cast gives NaN
    out = torch._scaled_mm(q, weight.qweight.t(), scale_a=scale, scale_b=weight.scales.reshape(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def _gemm_on_dequantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's GEMM on the weights in x's dtype, dequantized a slab of rows at a time (x's inputs
    are in the stored order already)."""
    n, k = weight.shape
    slab = max(256, DEQUANTIZE_SLAB_WEIGHTS // k // 256 * 256)  # whole 256s keep slab starts aligned
    if slab >= n:
        return F.linear(x, weight.dequantize_rows(0, n, x.dtype), bias)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, slab):
        stop = min(start + slab, n)
        out[:, start:stop] = F.linear(x, weight.dequantize_rows(start, stop, x.dtype),
                                      None if bias is None else bias[start:stop])
    return out
