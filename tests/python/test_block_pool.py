"""BlockPool: reference counts, the LRU free queue and the prefix cache, through the bindings.

The pool binding has no way to register a cache entry by hand, so the cache tests put blocks in
the cache the way the engine does: a scheduler runs a request whose full prompt blocks get
registered, and the test then looks at the scheduler's own pool.
"""

import numpy as np
import pytest

from octavo import _C

BS = 16  # block size of the scheduler-driven tests


# --- plain pool: reference counts and free-queue order -------------------------------------


def test_fresh_pool_state():
    pool = _C.BlockPool(6, 4)
    assert pool.num_blocks == 6
    assert pool.block_size == 4
    assert _C.BlockPool.null_block == 0
    assert pool.num_free_blocks == 5  # the null block is never free
    assert pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 0
    assert pool.usage == 0.0
    assert pool.free_queue() == [1, 2, 3, 4, 5]
    assert pool.ref_count(0) >= 1  # the null block is held for good
    assert not pool.is_cached(0)


def test_allocate_takes_from_the_front():
    pool = _C.BlockPool(6, 4)
    assert pool.allocate(2) == [1, 2]
    assert pool.free_queue() == [3, 4, 5]
    assert [pool.ref_count(b) for b in (1, 2, 3)] == [1, 1, 0]
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks - 1
    assert pool.usage == pytest.approx(2 / 5)
    assert pool.allocate(0) == []
    assert pool.free_queue() == [3, 4, 5]


def test_release_appends_in_lru_order():
    pool = _C.BlockPool(8, 4)
    blocks = pool.allocate(5)
    assert blocks == [1, 2, 3, 4, 5]
    assert pool.free_queue() == [6, 7]
    # Released blocks join the back in the order given: the first of them is evicted first.
    pool.release([4, 2])
    assert pool.free_queue() == [6, 7, 4, 2]
    pool.release([1])
    assert pool.free_queue() == [6, 7, 4, 2, 1]
    # The next allocations come from the front: least recently released first.
    assert pool.allocate(3) == [6, 7, 4]
    assert pool.free_queue() == [2, 1]
    pool.release([5, 3])
    assert pool.free_queue() == [2, 1, 5, 3]
    assert pool.allocate(4) == [2, 1, 5, 3]
    assert pool.free_queue() == []
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_shared_block_is_free_only_after_last_release():
    pool = _C.BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.touch([b])  # a second holder
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.ref_count(b) == 1
    assert b not in pool.free_queue()
    assert pool.num_used_blocks == 1
    pool.release([b])
    assert pool.ref_count(b) == 0
    assert pool.free_queue()[-1] == b
    assert pool.num_used_blocks == 0


def test_touch_of_free_block_unlinks_it():
    pool = _C.BlockPool(6, 4)
    pool.allocate(3)
    pool.release([1, 2, 3])
    assert pool.free_queue() == [4, 5, 1, 2, 3]
    pool.touch([2])
    assert pool.free_queue() == [4, 5, 1, 3]  # removed from the middle, order kept
    assert pool.ref_count(2) == 1
    assert pool.num_free_blocks == 4
    pool.touch([4, 3])  # front and back
    assert pool.free_queue() == [5, 1]
    pool.release([3, 2, 4])
    assert pool.free_queue() == [5, 1, 3, 2, 4]


def test_release_of_unused_block_raises():
    pool = _C.BlockPool(4, 4)
    with pytest.raises(ValueError, match="not in use"):
        pool.release([1])
    with pytest.raises(ValueError):
        pool.release([0])  # the null block is never released
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="not in use"):
        pool.release([b])


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = _C.BlockPool(4, 4)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate(3)
    assert pool.free_queue() == [2, 3]
    assert pool.num_free_blocks == 2


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = _C.BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert pool.reset_prefix_cache() is False
    pool.release(blocks[:1])
    assert pool.reset_prefix_cache() is False
    pool.release(blocks[1:])
    assert pool.reset_prefix_cache() is True


@pytest.mark.parametrize(
    "args, field",
    [((1,), "num_blocks"), ((0,), "num_blocks"), ((-3,), "num_blocks"), ((4, 0), "block_size"),
     ((4, -1), "block_size"), ((4, 2048), "block_size")],
)
def test_bad_arguments_raise_value_error(args, field):
    with pytest.raises(ValueError, match=field):
        _C.BlockPool(*args)


def test_smallest_pool_has_one_usable_block():
    pool = _C.BlockPool(2, 1)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [1]
    assert pool.num_free_blocks == 0


def test_caching_disabled_pool():
    pool = _C.BlockPool(4, 4, enable_caching=False)
    blocks = pool.allocate(3)
    pool.release(blocks)
    assert pool.num_cached_blocks == 0
    assert pool.reset_prefix_cache() is True


# --- hash_block_tokens ------------------------------------------------------------------------


def test_hash_is_deterministic_and_64_bit():
    tokens = list(range(100, 116))
    h = _C.hash_block_tokens(0, tokens, 0)
    assert h == _C.hash_block_tokens(0, list(tokens), 0)
    assert h == _C.hash_block_tokens(parent_hash=0, tokens=tokens)  # extra_key defaults to 0
    assert isinstance(h, int)
    assert 0 <= h < 2**64


def test_hash_depends_on_every_input():
    tokens = list(range(16))
    base = _C.hash_block_tokens(0, tokens, 0)
    assert _C.hash_block_tokens(1, tokens, 0) != base  # parent
    assert _C.hash_block_tokens(0, tokens, 7) != base  # extra key
    assert _C.hash_block_tokens(0, tokens[::-1], 0) != base  # order
    assert _C.hash_block_tokens(0, tokens[:-1], 0) != base  # length
    for i in range(16):
        changed = list(tokens)
        changed[i] += 1
        assert _C.hash_block_tokens(0, changed, 0) != base, i
    # Odd lengths and negative ids hash too.
    assert _C.hash_block_tokens(0, [1, 2, 3], 0) != _C.hash_block_tokens(0, [1, 2, 3, 0], 0)
    assert _C.hash_block_tokens(0, [-1], 0) != _C.hash_block_tokens(0, [1], 0)


def test_hash_is_chained():
    a, b, c = list(range(16)), list(range(16, 32)), list(range(32, 48))
    h_a = _C.hash_block_tokens(0, a, 0)
    h_ab = _C.hash_block_tokens(h_a, b, 0)
    h_abc = _C.hash_block_tokens(h_ab, c, 0)
    # The same block after a different prefix hashes differently.
    h_cb = _C.hash_block_tokens(_C.hash_block_tokens(0, c, 0), b, 0)
    assert h_cb != h_ab
    # Recomputing the chain gives the same values.
    assert _C.hash_block_tokens(_C.hash_block_tokens(h_a, b, 0), c, 0) == h_abc
    assert len({h_a, h_ab, h_abc, h_cb}) == 4


def test_hash_has_no_collisions_on_many_blocks():
    seen = {}
    for parent in range(4):
        for start in range(256):
            tokens = [start + k for k in range(16)]
            h = _C.hash_block_tokens(parent, tokens, parent % 2)
            assert h not in seen, (parent, start, seen.get(h))
            seen[h] = (parent, start)


# --- prefix cache entries of a scheduler's pool ---------------------------------------------


def _tokens(n, value=7):
    return np.full(n, value, dtype=np.int32)


def _run_to_completion(sched, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.update_from_output(_tokens(out.num_reqs))
    raise AssertionError("requests did not finish")


def _run_one_step(sched):
    out = sched.schedule()
    return sched.update_from_output(_tokens(out.num_reqs))


def _scheduler(num_blocks):
    return _C.Scheduler(_C.SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=256,
                                           max_num_batched_tokens=256))


def test_finished_request_leaves_cached_free_blocks_in_lru_order():
    sched = _scheduler(8)
    pool = sched.block_pool
    prompt = list(range(1000, 1000 + 2 * BS + 1))  # two full blocks and one token
    sched.add_request("a", prompt, max_tokens=1)
    out = sched.schedule()
    table = [int(b) for b in out.block_table[0]]
    assert table == [1, 2, 3]
    sched.update_from_output(_tokens(1))
    assert not sched.has_unfinished_requests()
    assert pool.num_used_blocks == 0
    # The request's blocks come back last block first, so its prefix is evicted last.
    assert pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]
    assert pool.is_cached(1) and pool.is_cached(2)
    assert pool.is_cached(3)  # a partial block (its one token), for requests that continue the sequence
    assert pool.num_cached_blocks == 3
    assert all(pool.ref_count(b) == 0 for b in range(1, 8))


def test_cached_free_block_is_evicted_only_when_allocated_again():
    sched = _scheduler(8)
    pool = sched.block_pool
    prompt_a = list(range(1000, 1000 + 2 * BS + 1))
    sched.add_request("a", prompt_a, max_tokens=1)
    _run_to_completion(sched)
    assert pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]

    # b takes the five blocks at the front; the cached blocks 2 and 1 stay cached and, once b's
    # blocks come back behind them, reach the front of the queue.
    prompt_b = list(range(2000, 2000 + 5 * BS - 1))
    sched.add_request("b", prompt_b, max_tokens=1)
    out = sched.schedule()
    assert [int(b) for b in out.block_table[0]] == [4, 5, 6, 7, 3]
    assert pool.free_queue() == [2, 1]
    sched.update_from_output(_tokens(1))
    assert pool.is_cached(1) and pool.is_cached(2)
    assert pool.free_queue() == [2, 1, 3, 7, 6, 5, 4]
    num_cached = pool.num_cached_blocks

    # c needs one block: it takes block 2 from the front and evicts its cache entry; block 1
    # (the prefix of a, released after it) survives.
    sched.add_request("c", list(range(3000, 3000 + BS - 1)), max_tokens=1)
    out = sched.schedule()
    assert [int(b) for b in out.block_table[0]] == [2]
    assert not pool.is_cached(2)
    assert pool.is_cached(1)
    assert pool.num_cached_blocks == num_cached - 1
    sched.update_from_output(_tokens(1))
    assert pool.is_cached(1)

    # a's first block still hits, its second does not.
    stats = dict(sched.prefix_cache_stats)
    sched.add_request("a2", prompt_a, max_tokens=1)
    out = sched.schedule()
    assert int(out.num_computed_tokens[0]) == BS
    assert int(out.block_table[0][0]) == 1
    assert sched.prefix_cache_stats["hits"] - stats["hits"] == BS
    sched.update_from_output(_tokens(1))


def test_touch_of_cached_free_block_removes_it_from_free_queue():
    sched = _scheduler(8)
    pool = sched.block_pool
    prompt = list(range(1000, 1000 + 2 * BS + 1))
    sched.add_request("a", prompt, max_tokens=1)
    _run_to_completion(sched)
    assert 1 in pool.free_queue() and 2 in pool.free_queue()
    free_before = pool.num_free_blocks

    sched.add_request("b", prompt, max_tokens=4)
    out = sched.schedule()
    assert int(out.num_computed_tokens[0]) == 2 * BS
    assert [int(b) for b in out.block_table[0][:2]] == [1, 2]
    queue = pool.free_queue()
    assert 1 not in queue and 2 not in queue
    assert pool.ref_count(1) == 1 and pool.ref_count(2) == 1
    assert pool.is_cached(1) and pool.is_cached(2)
    # Two hits touched, one new block allocated for the last token.
    assert pool.num_free_blocks == free_before - 3
    sched.update_from_output(_tokens(1))


def test_shared_cached_block_counts_every_holder():
    sched = _scheduler(16)
    pool = sched.block_pool
    prompt = list(range(500, 500 + 3 * BS))
    sched.add_request("a", prompt, max_tokens=8)
    _run_one_step(sched)  # a's prompt is computed and its full blocks cached
    sched.add_request("b", prompt + [1, 2], max_tokens=8)
    sched.add_request("c", prompt + [3], max_tokens=8)
    out = sched.schedule()
    sched.update_from_output(_tokens(out.num_reqs))
    first = sched.request_state(sched.handle_of("a"))["block_ids"][0]
    for rid in ("b", "c"):
        assert sched.request_state(sched.handle_of(rid))["block_ids"][0] == first
    assert pool.ref_count(first) == 3
    assert sched.block_ref_counts()[first] == 3


def test_reset_prefix_cache_through_scheduler():
    sched = _scheduler(8)
    pool = sched.block_pool
    prompt = list(range(1000, 1000 + 2 * BS + 1))
    sched.add_request("a", prompt, max_tokens=1)
    _run_to_completion(sched)
    assert pool.num_cached_blocks == 3  # two full blocks and the partial third

    sched.add_request("b", list(range(5000, 5000 + BS)), max_tokens=4)
    _run_one_step(sched)
    assert pool.num_used_blocks > 0
    assert sched.reset_prefix_cache() is False
    assert pool.reset_prefix_cache() is False
    assert pool.is_cached(1) and pool.is_cached(2)

    _run_to_completion(sched)
    assert sched.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert not any(pool.is_cached(b) for b in range(pool.num_blocks))
    assert pool.num_free_blocks == pool.num_blocks - 1

    # Nothing hits after the reset.
    sched.add_request("a2", prompt, max_tokens=1)
    out = sched.schedule()
    assert int(out.num_computed_tokens[0]) == 0
    sched.update_from_output(_tokens(1))


def test_scheduler_config_rejects_bad_pool_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        _C.SchedulerConfig(num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        _C.SchedulerConfig(num_blocks=8, block_size=0)
