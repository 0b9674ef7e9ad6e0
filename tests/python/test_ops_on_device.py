"""ops_on_device.py, through which the CUDA test files run the CPU tests' cases, checked on the
CPU (its "cpu" device gets copies of the storages too)."""

import types

import torch
import test_attention
import test_elementwise_ops
from octavo import _C
from ops_on_device import _on_device, run_ops_on


def test_ops_see_copies_that_keep_views_and_aliasing():
    qkv = torch.zeros(3, 10)
    seen = {}

    def op(query, key, flag):
        seen.update(q=query.data_ptr(), k=key.data_ptr(), stride=query.stride(), flag=flag)
        assert key.data_ptr() == query.data_ptr() + 4 * query.element_size()  # still one buffer
        query.fill_(1.0)
        key[:, 0] = 2.0  # a write the caller's view does not see, but its storage does

    _on_device(op, "cpu")(qkv[:, :4], qkv[:, 4:6], flag="x")
    assert seen["q"] != qkv.data_ptr() and seen["stride"] == (10, 1) and seen["flag"] == "x"
    expected = torch.zeros(3, 10)
    expected[:, :4], expected[:, 4] = 1.0, 2.0
    assert torch.equal(qkv, expected)


def test_the_cpu_tests_pass_through_it(monkeypatch):
    run_ops_on(test_elementwise_ops, "cpu", monkeypatch)
    run_ops_on(test_attention, "cpu", monkeypatch)
    assert test_attention._C.ops is not _C.ops
    test_elementwise_ops.test_fused_add_rms_norm_strided(None, torch.bfloat16)
    test_elementwise_ops.test_rotary_embedding(None, torch.bfloat16, False, 80, 40, 7, 4, 2)
    test_elementwise_ops.test_gated_activation_strided(None, "silu")
    test_attention.test_edges(None, torch.bfloat16)
    test_attention.test_reshape_and_cache_writes_slots_and_skips_padding(None, torch.float32)
    assert test_attention._C.get_num_threads() == _C.get_num_threads()  # the rest of _C is _C's


def test_an_out_argument_comes_back(monkeypatch):
    module = types.SimpleNamespace(_C=_C)
    run_ops_on(module, "cpu", monkeypatch)
    x = torch.randn(4, 64)
    out = torch.zeros(4, 64)
    module._C.ops.rms_norm(out, x, torch.ones(64), 1e-6)
    ref = torch.empty_like(out)
    _C.ops.rms_norm(ref, x, torch.ones(64), 1e-6)
    assert torch.equal(out, ref)
