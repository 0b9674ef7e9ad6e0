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
