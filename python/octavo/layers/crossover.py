"""Where torch's GEMM overtakes Octavo's ``linear`` kernel, measured on this machine.

The crossover depends on the CPU: on the AMD EPYC of the first benchmarks torch's MKL float32 GEMM
lost to Octavo's kernel at every row count, on an Intel Xeon it wins from about 64 rows; with AMX
tiles Octavo's bfloat16 kernel is ahead of oneDNN's to large M. So on the CPU the engine measures
it once per machine, model shapes and dtype, when it loads a model: both products on the model's
own projection shapes (weights trimmed to at most PROBE_MAX_WEIGHTS, inputs at PROBE_ROWS rows),
each timed as the best of PROBE_REPEATS alternating runs, summed over the model's distinct
shapes (one decoder layer's projections and the LM head). The crossover is the smallest probed
row count from which torch is faster at every larger probe, by PROBE_MARGIN at the first. The
result is cached in Octavo's cache directory (``linear_crossover.json``), keyed by the CPU, its
kernel level, the thread count, torch's and Octavo's versions, a hash of the compiled extension
(a build from source keeps its version number when its kernels change), the dtype and the
shapes, so later starts read it. Delete the file to measure again.

``OCTAVO_LINEAR_CROSSOVER=builtin`` skips the probe and keeps the built-in table in
``layers/linear.py`` (the tests do, so that which product runs never depends on the machine).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import _C, __version__

PROBE_ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 1024)
PROBE_REPEATS = 3
PROBE_MAX_WEIGHTS = 1 << 21  # a 49152 x 576 LM head is probed on its first 3640 rows
PROBE_MARGIN = 1.1
PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def machine_key(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> str:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return "|".join([cpu, _C.cpu_isa(), str(_C.get_num_threads()), torch.__version__, __version__, extension_hash(),
                     str(dtype), ",".join(f"{n}x{k}" for n, k in shapes)])


@functools.cache
def extension_hash() -> str:
    """The first 12 hex digits of the compiled extension's SHA-1 (about 20 ms for its 9 MB, once
    per process)."""
    return hashlib.sha1(Path(_C.__file__).read_bytes()).hexdigest()[:12]


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe(dtype: torch.dtype, shapes: list[tuple[int, int]], rows=PROBE_ROWS, repeats: int = PROBE_REPEATS) -> float:
    """The row count from which torch's F.linear is the faster product for weights of these
    (out, in) shapes, or inf when Octavo's kernel wins throughout."""
    weights = [torch.randn(max(1, min(n, PROBE_MAX_WEIGHTS // k)), k).to(dtype) for n, k in shapes]
    ratios = []
    for m in rows:
        inputs = [torch.randn(m, w.shape[1]).to(dtype) for w in weights]
        outs = [torch.empty(m, w.shape[0], dtype=dtype) for w in weights]

        def octavo():
            for x, w, out in zip(inputs, weights, outs):
                _C.ops.linear(out, x, w, None)

        def torch_gemm():
            for x, w in zip(inputs, weights):
                F.linear(x, w)

        octavo(), torch_gemm()  # warm-up: first-call allocations, weight packing caches
        ours = theirs = math.inf
        for _ in range(repeats):  # alternating, so a drift of the machine hits both
            ours, theirs = min(ours, _seconds(octavo)), min(theirs, _seconds(torch_gemm))
        ratios.append(ours / theirs)
    return crossover_from(rows, ratios)


def crossover_from(rows, ratios) -> float:
    """The smallest row count from which every ratio (Octavo's time / torch's) is above 1, the
    first by PROBE_MARGIN; inf if there is none."""
    found = math.inf
    for m, ratio in zip(reversed(rows), reversed(ratios)):
        if ratio <= 1.0:
            break
        if ratio >= PROBE_MARGIN:
            found = m
    return found


def cache_path() -> Path:
    from ..default_model import cache_dir

    return cache_dir() / "linear_crossover.json"


def torch_from_rows(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> float:
    """The crossover for this machine, dtype and shapes: from the cache, else probed and cached."""
    key = machine_key(dtype, shapes)
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
        cached = cached if isinstance(cached, dict) else {}
        if key in cached:
            return float(cached[key])
    except (OSError, ValueError, TypeError):
        cached = {}  # missing, unreadable or edited by hand: measure again and rewrite it
    found = probe(dtype, shapes)
    print(f"octavo: measured where torch's GEMM overtakes Octavo's linear on this CPU ({dtype}): "
          f"{'never' if math.isinf(found) else f'from {found} rows'}; cached in {path}")
    cached[key] = found if math.isfinite(found) else "inf"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache costs a probe per start, nothing else
    return found


def layer_shapes(model) -> list[tuple[int, int]]:
    """The dense (out, in) weight shapes of the model's first decoder layer and its LM head."""
    from .linear import QuantizedWeight

    shapes = []
    for module, attr, _ in model.matmul_weights():
        weight = getattr(module, attr)
        if isinstance(weight, QuantizedWeight) or weight.dim() != 2:
            continue
        shape = tuple(weight.shape)
        if shape not in shapes:  # every layer has the same shapes: the first layer's, then the head
            shapes.append(shape)
    return shapes


def calibrate(model) -> float | None:
    """Sets layers.linear's crossover for the model's dtype from this machine's measurement (CPU
    models with dense weights); returns it, or None when nothing was measured."""
    from . import linear

    if os.environ.get("OCTAVO_LINEAR_CROSSOVER", "probe") == "builtin" or model.dtype not in PROBED_DTYPES:
        return None
    if model.embed_tokens.device.type != "cpu":
        return None
    shapes = layer_shapes(model)
    if not shapes:
        return None
    found = torch_from_rows(model.dtype, shapes)
    linear.TORCH_FROM_ROWS[model.dtype] = found
    return found
