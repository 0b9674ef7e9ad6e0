"""Tensors cross into C++ zero-copy through DLPack: Octavo sees the producer's own memory."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo._C.testing import describe_tensor


def expect_torch(t: torch.Tensor, dtype: str) -> None:
    d = describe_tensor(t, name="t")
    assert d["data_ptr"] == t.data_ptr()
    assert d["dtype"] == dtype
    assert d["device"] == t.device.type
    assert d["device_index"] == (t.device.index or 0)
    assert d["shape"] == tuple(t.shape)
    assert d["strides"] == tuple(t.stride())


def expect_numpy(a: np.ndarray, dtype: str) -> None:
    d = describe_tensor(a, name="a")
    assert d["data_ptr"] == a.ctypes.data
    assert d["dtype"] == dtype
    assert (d["device"], d["device_index"]) == ("cpu", 0)
    assert d["shape"] == a.shape
    assert d["strides"] == tuple(s // a.itemsize for s in a.strides)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
              torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn]
)
def test_torch_cpu_dtypes(dtype):
    expect_torch(torch.zeros(3, 5, dtype=dtype), str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8", "uint8", "int32", "int64", "bool"])
def test_numpy_dtypes(dtype):
    expect_numpy(np.zeros((4, 2), dtype=dtype), dtype)


def test_torch_non_contiguous_views_keep_real_strides():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    expect_torch(base[:, ::2, 1:], "float32")  # strided, with a byte offset
    expect_torch(base.transpose(0, 2), "float32")
    expect_torch(base[1], "float32")
    assert describe_tensor(base[1:, 2:])["data_ptr"] != base.data_ptr()


def test_numpy_non_contiguous_views_keep_real_strides():
    base = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    expect_numpy(base[:, ::2, 1:], "int64")
    expect_numpy(base.T, "int64")
    expect_numpy(base[2:, 1:], "int64")


def test_zero_dim_and_empty():
    expect_torch(torch.tensor(3.0), "float32")
    expect_torch(torch.empty(0, 4), "float32")


@settings(max_examples=50, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_random_slices_match_torch(shape, data):
    base = torch.zeros(shape, dtype=torch.int32)
    index = tuple(
        slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.integers(1, 3))) for n in shape
    )
    expect_torch(base[index], "int32")


def test_capsule_is_released():
    a = np.zeros(16, dtype=np.float32)
    before = sys.getrefcount(a)
    for _ in range(100):
        describe_tensor(a)
    assert sys.getrefcount(a) == before


@pytest.mark.parametrize("obj", [[1.0, 2.0], "tensor", 3.5, None])
def test_non_tensors_raise_type_error_naming_the_argument(obj):
    with pytest.raises(TypeError, match=r"argument 'x' must be a torch tensor or numpy array, got"):
        describe_tensor(obj, name="x")


def test_type_name_in_message():
    with pytest.raises(TypeError, match=r"got list"):
        describe_tensor([1, 2], name="x")


@pytest.mark.parametrize("t", [torch.zeros(2, dtype=torch.complex64), np.zeros(2, dtype=np.uint16),
                               torch.zeros(2, dtype=torch.float8_e5m2)])
def test_unsupported_dtype_raises_type_error(t):
    with pytest.raises(TypeError, match=r"argument 'w' has unsupported dtype"):
        describe_tensor(t, name="w")


def test_unsupported_device_raises_value_error():
    class OpenCLTensor:
        def __dlpack_device__(self):
            return (4, 0)  # kDLOpenCL

        def __dlpack__(self, **kwargs):
            raise AssertionError("must not be exported")

    with pytest.raises(ValueError, match=r"argument 'q' is on an unsupported device"):
        describe_tensor(OpenCLTensor(), name="q")


def test_refused_exports_name_the_argument():
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    for t in (readonly, torch.zeros(2, requires_grad=True)):
        with pytest.raises(ValueError, match=r"argument 'r' cannot be viewed zero-copy"):
            describe_tensor(t, name="r")


def test_too_many_dimensions_raise_value_error():
    with pytest.raises(ValueError, match=r"argument 'big' has 9 dimensions"):
        describe_tensor(torch.zeros([1] * 9), name="big")


@pytest.mark.cuda
def test_torch_cuda_tensor():
    t = torch.arange(32, dtype=torch.bfloat16, device="cuda").reshape(4, 8)[:, 1::2]
    expect_torch(t, "bfloat16")
    assert describe_tensor(t)["device"] == "cuda"
