"""test_sampling.py's tests again, on the CUDA sampling kernel (skipped without a GPU). The
draws use the CPU kernel's random numbers, so the same statistical bounds apply."""

import pytest
import test_sampling
from octavo import _C
from test_sampling import *  # noqa: F401,F403  (the tests themselves)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels")]


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    monkeypatch.setattr(test_sampling, "DEVICE", "cuda")


# Argument checks belong to the op adapter, which these call with CPU tensors: tested once there.
del test_bad_arguments_raise_clear_errors  # noqa: F821
del test_rejection_sample_checks_its_drafts  # noqa: F821


def test_penalties_without_token_lists_are_refused():
    """The CPU reads the penalties and lets neutral ones come without token lists; on CUDA their
    values are not read on the host, so penalties without their lists are refused outright
    rather than silently ignored."""
    import torch

    logits, sampled = torch.randn(2, 10, device="cuda"), torch.empty(2, dtype=torch.int32, device="cuda")
    args = (logits, torch.ones(2, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda"),
            torch.zeros(2, dtype=torch.int64, device="cuda"), sampled)
    with pytest.raises(ValueError, match="repetition_penalty needs the prompt and/or output token lists"):
        _C.ops.sample(*args, repetition_penalty=torch.ones(2, device="cuda"))
    with pytest.raises(ValueError, match="frequency_penalty and presence_penalty need"):
        _C.ops.sample(*args, presence_penalty=torch.zeros(2, device="cuda"))
    offsets, ids = torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda"), torch.tensor([3], dtype=torch.int32,
                                                                                            device="cuda")
    _C.ops.sample(*args, repetition_penalty=torch.ones(2, device="cuda"), frequency_penalty=torch.zeros(2, device="cuda"),
                  output_offsets=offsets, output_token_ids=ids)


@pytest.mark.parametrize("vocab", [33, 49152, 151936])
def test_apply_token_bitmask_matches_the_cpu(vocab):
    import torch
    from test_token_bitmask import random_mask

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    mask = random_mask(3, vocab, gen, 0.2)
    indices = torch.tensor([5, 0, 3], dtype=torch.int32)
    on_gpu = logits.cuda()
    _C.ops.apply_token_bitmask(logits, mask, indices)
    _C.ops.apply_token_bitmask(on_gpu, mask.cuda(), indices.cuda())
    assert torch.equal(on_gpu.cpu(), logits)
