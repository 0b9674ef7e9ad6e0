"""Drives an octavo._C build whose libstdc++ is linked statically, after ``import torch``.

usage: check_module.py PATH_TO_C_MODULE   (exit 0: passed, 1: failed, 77: torch is missing)

torch loads the system's libstdc++ first (here it is also put in the global scope, where any
module's unresolved or exported symbols would be bound to it). A module that carries its own copy
must keep to it: where it did not, an error message formatted with an ostream lost its numbers on
the CPU and crashed on a GPU. The module must export its entry point alone; each check below
formats numbers into a message, or runs an op; the CUDA ones run where a GPU is present.
"""

import ctypes
import importlib.util
import shutil
import subprocess
import sys

try:
    import torch
except ImportError:
    sys.exit(77)


def load(path: str):
    spec = importlib.util.spec_from_file_location("_C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raises(kind, message: str, fn, *args) -> None:
    try:
        fn(*args)
    except kind as e:
        assert message in str(e), f"expected {message!r} in the message, got {str(e)!r}"
        return
    raise AssertionError(f"expected {kind.__name__}: {message}")


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def check_cpu(ops) -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    out = torch.empty(4, 64)
    raises(ValueError, "argument 'weight' must have size 64 in dimension 0, got 63", ops.rms_norm, out, x,
           torch.ones(63), 1e-6)
    raises(TypeError, "float64", ops.rms_norm, out, x, w.double(), 1e-6)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    a, b = torch.randn(3, 64), torch.randn(48, 64)
    y = torch.empty(3, 48)
    ops.linear(y, a, b, None)
    torch.testing.assert_close(y, (a.double() @ b.double().T).float(), rtol=1e-4, atol=1e-4)


def check_cuda(ops, module) -> None:
    module.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
    x, w = torch.randn(4, 64, device="cuda"), torch.randn(64, device="cuda")
    out = torch.empty_like(x)
    raises(ValueError, "argument 'weight' is on cpu:0 but 'input' is on cuda:0", ops.rms_norm, out, x, w.cpu(), 1e-6)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out.cpu(), rms_norm_reference(x.cpu(), w.cpu(), 1e-6), rtol=1e-5, atol=1e-5)
    # The sampler's workspace (its size formatted into any error) at a large vocabulary: greedy rows.
    rows, vocab = 213, 128256
    logits = torch.randn(rows, vocab, device="cuda")
    tokens = torch.empty(rows, dtype=torch.int32, device="cuda")
    ops.sample(logits, torch.zeros(rows, device="cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda"),
               torch.zeros(rows, dtype=torch.int64, device="cuda"), tokens)
    assert torch.equal(tokens.long().cpu(), logits.argmax(-1).cpu()), "greedy tokens differ from argmax"


def tool_output(*command: str) -> str | None:
    """A binutils / libc tool's output, or None where the tool is not installed."""
    if shutil.which(command[0]) is None:
        print(f"{command[0]} is not installed: its check is skipped")
        return None
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def main(path: str) -> None:
    linked = tool_output("ldd", path)
    assert linked is None or "libstdc++" not in linked, \
        f"the module links libstdc++ dynamically; the case is not set up:\n{linked}"
    exported = tool_output("nm", "-D", "--defined-only", path)
    if exported is not None:
        names = {line.split()[-1] for line in exported.splitlines() if line.strip()}
        assert names == {"PyInit__C"}, f"the module exports more than its entry point: {sorted(names)[:20]}"
    ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    module = load(path)
    check_cpu(module.ops)
    print("CPU: error messages whole, ops correct")
    if module.cuda_device_count() > 0 and torch.cuda.is_available():
        check_cuda(module.ops, module)
        print("CUDA: error messages whole, ops correct")
    else:
        print("CUDA: no GPU here, not checked")


if __name__ == "__main__":
    main(sys.argv[1])
