"""apply_token_bitmask on every compiled CPU ISA: against a NumPy reading of the bit layout and
against xgrammar's own kernel on the same masks, on strided rows and index lists; its argument
checks; and hypothesis over vocabulary sizes, masks and row choices."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from octavo import _C


def reference(logits: torch.Tensor, bitmask: torch.Tensor, indices=None) -> torch.Tensor:
    """Bit t % 32 of word t / 32 (little-endian bit order) set = allowed."""
    out = logits.clone()
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    rows = range(len(bitmask)) if indices is None else indices.tolist()
    for i, r in enumerate(rows):
        out[r, ~torch.from_numpy(bits[i])] = float("-inf")
    return out


def random_mask(rows: int, vocab: int, gen: torch.Generator, density: float = 0.5) -> torch.Tensor:
    """Words of every kind: all clear, all set, and mixed."""
    words = -(-vocab // 32)
    bits = (torch.rand(rows, words * 32, generator=gen) < density).to(torch.uint8).numpy()
    mask = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
    mask[:, ::7] = 0
    mask[:, 3::7] = -1
    return mask


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152, 151936])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_matches_reference(isa, vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    mask = random_mask(5, vocab, gen, density)
    expected = reference(logits, mask)
    _C.ops.apply_token_bitmask(logits, mask)
    assert torch.equal(logits, expected)


def test_index_list_and_strided_rows(isa):
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    base = torch.randn(6, vocab + 24, generator=gen)
    logits = base[:, :vocab]  # rows 1024 floats apart
    untouched = base[:, vocab:].clone()
    indices = torch.tensor([4, 0, 2], dtype=torch.int32)
    mask = random_mask(3, vocab, gen)
    expected = reference(logits, mask, indices)
    _C.ops.apply_token_bitmask(logits, mask, indices)
    assert torch.equal(logits, expected)
    assert torch.equal(base[:, vocab:], untouched)


def test_matches_xgrammar(isa):
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(11)
    vocab = 49152
    logits = torch.randn(4, vocab, generator=gen)
    mask = random_mask(4, vocab, gen, 0.1)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask)
    _C.ops.apply_token_bitmask(logits, mask)
    assert torch.equal(logits, theirs)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 300), batch=st.integers(1, 6), data=st.data())
def test_any_shape_and_rows(vocab, batch, data):
    rows = data.draw(st.lists(st.integers(0, batch - 1), unique=True, max_size=batch))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    mask = random_mask(len(rows), vocab, gen, data.draw(st.floats(0, 1)))
    indices = torch.tensor(rows, dtype=torch.int32)
    expected = reference(logits, mask, indices)
    _C.ops.apply_token_bitmask(logits, mask, indices)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("make, message", [
    (lambda: (torch.zeros(2, 64, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.int32), None), "float32"),
    (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None), "int32"),
    (lambda: (torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.int32), None), "2 words per row"),
    (lambda: (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), None), "one row per row"),
    (lambda: (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)),
     "not a row of 'logits'"),
    (lambda: (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)),
     "not a row of 'logits'"),
    (lambda: (torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)),
     "twice"),
    (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)),
     "indices"),
])
def test_bad_arguments(make, message):
    logits, mask, indices = make()
    with pytest.raises((ValueError, TypeError), match=message):
        _C.ops.apply_token_bitmask(logits, mask, indices)
