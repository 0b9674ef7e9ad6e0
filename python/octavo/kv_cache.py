"""Memory for the paged KV cache.

Attention on the CPU reads each (block, KV head) tile of the cache as a few KiB scattered over
gigabytes; with 4 KiB pages nearly every tile costs a TLB miss and a page walk. Asking the kernel
for transparent huge pages (2 MiB) removes most of them: decode attention over 2 GiB of cache
runs about a third faster on the project's CPU machine (bench/RESULTS.md).

The pages are faulted in when the cache is made (written with zeros, as vLLM allocates its caches
with ``torch.zeros``): left to the first write of each block, a fault took up to 4 ms per huge page
(the kernel zeroes and may compact memory for it) inside ``reshape_and_cache``, on the step's
critical path: 1.4 s of a 17 s batched run of 64 requests on the CPU machine.
"""

from __future__ import annotations

import math
import mmap

import torch

_HUGE_PAGE = 2 << 20

# kv_cache_dtype values (vLLM's names; "float16" as llama.cpp's default cache type) and what they store.
# "fp8" is vLLM's default fp8 format, E4M3: each layer's cache holds K / k_scale and V / v_scale
# (Attention.kv_scales: 1.0, or the checkpoint's), rounded to E4M3 and saturated at +-448.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                   "float32": torch.float32, "float": torch.float32, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn}


def check_kv_cache_dtype(name) -> torch.dtype | None:
    """kv_cache_dtype ``name``'s dtype (None: "auto"); a ValueError for a name it does not know."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        hint = " (of the fp8 formats, E4M3 is supported: 'fp8')" if str(name).startswith("fp8") else ""
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {name!r}{hint}")
    return KV_CACHE_DTYPES[name]


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a KV cache of kv_cache_dtype ``name`` holds for a model of ``model_dtype``.

    On the CPU the cache may hold another float dtype than the model's, or fp8 (the kernels convert K
    and V as they are written and read: a 16-bit cache halves the bytes decode attention streams,
    fp8 quarters them). On CUDA it holds the model's dtype or fp8.
    """
    dtype = check_kv_cache_dtype(name) or model_dtype
    if device.type != "cpu" and dtype not in (model_dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache_dtype={name!r} with a {str(model_dtype).removeprefix('torch.')} model: "
                         "on CUDA the KV cache holds the model's dtype or fp8 (use 'auto' or 'fp8')")
    return dtype


def empty_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor for a paged KV cache ``[num_blocks, num_kv_heads, block_size, head_size]``.

    On the CPU the memory is an anonymous mapping advised for transparent huge pages where the
    OS supports it (Linux ``MADV_HUGEPAGE``), zeroed; elsewhere a plain (uninitialized) ``torch.empty``.
    """
    device = torch.device(device)
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP disabled ("never"): ordinary pages still work
    # frombuffer keeps the mapping alive for as long as the tensor lives.
    cache = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    cache.zero_()  # faults every page in now, on all threads
    return cache.view(dtype).view(shape)
