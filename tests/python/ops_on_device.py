"""A CPU test file's own cases, run on another device's kernels.

``run_ops_on(module, device, monkeypatch)`` swaps the ``_C`` that a test module calls for one
whose ops take the module's CPU tensors and run on ``device``: each tensor's whole storage is
copied there and viewed with the same offset, shape and strides (so views of one buffer stay
views of one buffer, and 16-byte alignment within it is kept), the op runs, and every storage is
copied back. Writes in place, writes into the gaps of a strided view and stray writes into an
input all come back to the CPU tensors the test then checks, so the test's own assertions (most
against float64 references) judge the other device's kernel unchanged.
"""

from __future__ import annotations

import pytest
import torch
from octavo import _C


def _on_device(op, device: str):
    def run(*args, **kwargs):
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage address -> (CPU bytes, device bytes)

        def moved(t):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return t
            storage = t.untyped_storage()
            if storage.data_ptr() not in copies:
                host = torch.empty(0, dtype=torch.uint8).set_(storage)
                # clone(): a "cpu" device still gets storages of its own, which the self-test needs.
                copies[storage.data_ptr()] = (host, host.to(device) if device != "cpu" else host.clone())
            there = copies[storage.data_ptr()][1].untyped_storage()
            return torch.empty(0, dtype=t.dtype, device=device).set_(there, t.storage_offset(), t.shape, t.stride())

        result = op(*[moved(a) for a in args], **{k: moved(v) for k, v in kwargs.items()})
        for host, there in copies.values():
            host.copy_(there)  # waits for the device
        return result

    return run


class _OpsOn:
    def __init__(self, device: str):
        self._device = device

    def __getattr__(self, name: str):
        return _on_device(getattr(_C.ops, name), self._device)


class _ModuleOn:
    """octavo._C, but for its ops."""

    def __init__(self, device: str):
        self.ops = _OpsOn(device)

    def __getattr__(self, name: str):
        return getattr(_C, name)


def run_ops_on(module, device: str, monkeypatch) -> None:
    """Makes ``module``'s calls of ``_C.ops.X`` run on ``device`` for the current test."""
    monkeypatch.setattr(module, "_C", _ModuleOn(device))


def rerun_on_cuda(module):
    """(pytestmark, isa, _on_cuda) for a test file that star-imports ``module``'s tests to run them
    on CUDA: skipped without a GPU or CUDA kernels, once per case (the CPU kernel level does not
    reach the CUDA kernels), with the ops on CUDA."""
    marks = [pytest.mark.cuda,
             pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels")]

    @pytest.fixture
    def isa():
        return None

    @pytest.fixture(autouse=True)
    def _on_cuda(monkeypatch):
        run_ops_on(module, "cuda", monkeypatch)

    return marks, isa, _on_cuda
