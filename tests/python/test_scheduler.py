"""The continuous-batching scheduler through its Python bindings: flat batch arrays, numpy views,
sampled-token input checks, chunked prefill, the prefix cache, stop rules, aborts, preemption
and request validation."""

import gc

import numpy as np
import pytest
import torch

from octavo import _C

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 0, 1, 2, 3


def make_scheduler(num_blocks=64, **kwargs):
    return _C.Scheduler(_C.SchedulerConfig(num_blocks=num_blocks, **kwargs))


def default_sample(handle, num_outputs):
    """Deterministic token for a request's next output: never 0..9 (kept for eos/stop tests)."""
    return 10 + (7919 * handle + 104729 * num_outputs) % 997


def check_batch(sched, out, tokens_of=None):
    """Asserts that the flat arrays of one SchedulerOutput describe a consistent batch."""
    bs = sched.config.block_size
    R = out.num_reqs
    handles = out.req_handles
    nsched = out.num_scheduled_tokens.astype(np.int64)
    ncomp = out.num_computed_tokens.astype(np.int64)
    T = int(nsched.sum())
    assert len(handles) == R and len(nsched) == R and len(ncomp) == R
    assert len(out.is_new) == R and len(out.seq_lens) == R and len(out.logits_indices) == R
    assert len(set(handles.tolist())) == R, "a request appears twice in the batch"
    assert out.total_num_scheduled_tokens == T
    assert len(out.input_ids) == T and len(out.positions) == T and len(out.slot_mapping) == T
    assert (nsched >= 1).all()
    qsl = out.query_start_loc
    assert len(qsl) == R + 1
    assert qsl[0] == 0
    assert np.array_equal(qsl[1:], np.cumsum(nsched))
    assert np.array_equal(out.seq_lens, ncomp + nsched)
    assert np.array_equal(out.logits_indices, qsl[1:] - 1)
    assert T <= sched.config.max_num_batched_tokens
    assert R <= sched.config.max_num_seqs

    table = out.block_table
    assert table.ndim == 2 and table.shape[0] == R
    width = table.shape[1]
    for i, h in enumerate(handles.tolist()):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        pos = out.positions[lo:hi]
        assert np.array_equal(pos, np.arange(ncomp[i], ncomp[i] + nsched[i])), f"positions of request {h}"
        blocks = sched.request_state(h)["block_ids"]
        assert len(blocks) <= width
        assert list(table[i, : len(blocks)]) == blocks
        assert (table[i, len(blocks):] == 0).all(), "block table padding must be the null block"
        assert 0 not in blocks
        # Every scheduled token has a slot in one of the request's blocks.
        assert int(out.seq_lens[i]) <= len(blocks) * bs
        expected_slots = table[i, pos // bs].astype(np.int64) * bs + pos % bs
        assert np.array_equal(out.slot_mapping[lo:hi], expected_slots)
        if tokens_of is not None:
            toks = tokens_of[h]
            assert list(out.input_ids[lo:hi]) == toks[ncomp[i] : ncomp[i] + nsched[i]], f"input ids of request {h}"
    if R:
        assert width == max(len(sched.request_state(h)["block_ids"]) for h in handles.tolist())
    else:
        assert width == 0


class Driver:
    """Runs a scheduler step by step with a deterministic sampler and records what came out."""

    def __init__(self, sched, sample=default_sample):
        self.sched = sched
        self.sample = sample
        self.tokens = {}  # handle -> prompt + outputs
        self.outputs = {}
        self.finish_reason = {}
        self.stop_reason = {}
        self.handle = {}
        self.steps = []

    def add(self, request_id, prompt, **kwargs):
        h = self.sched.add_request(request_id, list(prompt), **kwargs)
        self.handle[request_id] = h
        self.tokens[h] = list(prompt)
        self.outputs[h] = []
        return h

    def step(self, dtype=np.int32):
        out = self.sched.schedule()
        check_batch(self.sched, out, self.tokens)
        handles = out.req_handles.tolist()
        batch = {
            "req_handles": handles,
            "num_scheduled_tokens": out.num_scheduled_tokens.tolist(),
            "num_computed_tokens": out.num_computed_tokens.tolist(),
            "is_new": out.is_new.tolist(),
            "preempted": out.preempted_handles.tolist(),
            "finished": out.finished_handles.tolist(),
            "num_tokens": [len(self.tokens[h]) for h in handles],
        }
        sampled = np.array([self.sample(h, len(self.outputs[h])) for h in handles], dtype=dtype)
        up = self.sched.update_from_output(sampled)
        assert up.req_handles.tolist() == handles
        offs = up.new_token_offsets.tolist()
        assert len(offs) == len(handles) + 1 and offs[0] == 0
        new_ids = up.new_token_ids.tolist()
        reasons = up.finish_reasons.tolist()
        stops = up.stop_reasons.tolist()
        for i, h in enumerate(handles):
            new = new_ids[offs[i] : offs[i + 1]]
            done_prefill = batch["num_computed_tokens"][i] + batch["num_scheduled_tokens"][i] == len(self.tokens[h])
            assert len(new) == (1 if done_prefill else 0), f"request {h} got {new}"
            if new:
                assert new == [int(sampled[i])]
            self.outputs[h] += new
            self.tokens[h] += new
            if reasons[i] != FINISH_RUNNING:
                self.finish_reason[h] = reasons[i]
                self.stop_reason[h] = stops[i]
                assert self.sched.request_state(h) is None
            else:
                assert stops[i] == -1
        batch["finish_reasons"] = reasons
        batch["stop_reasons"] = stops
        self.steps.append(batch)
        return batch

    def run(self, max_steps=10000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("scheduler did not finish its requests")


def assert_all_free(sched):
    pool = sched.block_pool
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks - 1
    refs = sched.block_ref_counts()
    assert all(r == 0 for r in refs[1:])
    assert pool.num_cached_blocks <= pool.num_blocks - 1


# --- flat arrays ------------------------------------------------------------------------------


def test_flat_arrays_of_mixed_batches_are_consistent():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=24, max_model_len=128)
    d = Driver(sched)
    d.add("a", range(100, 130), max_tokens=6)  # 30 tokens: chunked over two steps
    d.add("b", range(200, 205), max_tokens=9)
    d.add("c", range(300, 311), max_tokens=4)
    saw_mixed = False
    for k in range(200):
        if not sched.has_unfinished_requests():
            break
        if k == 3:
            d.add("d", range(400, 450), max_tokens=3)  # arrives while the others decode
        batch = d.step()
        pool = sched.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks - 1
        kinds = {n == 1 for n in batch["num_scheduled_tokens"]}
        saw_mixed |= len(batch["req_handles"]) > 1 and kinds == {True, False}
    assert not sched.has_unfinished_requests()
    assert saw_mixed, "expected a step mixing decodes and prefill chunks"
    assert [len(d.outputs[d.handle[r]]) for r in "abcd"] == [6, 9, 4, 3]
    assert all(d.finish_reason[h] == FINISH_LENGTH for h in d.outputs)
    assert_all_free(sched)


def test_first_step_layout():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    h1 = sched.add_request("x", [5, 6, 7, 8, 9, 10], max_tokens=2)
    h2 = sched.add_request("y", [11, 12, 13], max_tokens=2)
    out = sched.schedule()
    assert out.req_handles.tolist() == [h1, h2]
    assert out.num_scheduled_tokens.tolist() == [6, 3]
    assert out.num_computed_tokens.tolist() == [0, 0]
    assert out.is_new.tolist() == [1, 1]
    assert out.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert out.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert out.query_start_loc.tolist() == [0, 6, 9]
    assert out.seq_lens.tolist() == [6, 3]
    assert out.logits_indices.tolist() == [5, 8]
    assert out.block_table.shape == (2, 2)
    assert out.block_table[1, 1] == 0  # y needs one block: padded with the null block
    bt = out.block_table
    assert out.slot_mapping.tolist() == [bt[0, 0] * 4 + k for k in range(4)] + [bt[0, 1] * 4 + k for k in range(2)] + [
        bt[1, 0] * 4 + k for k in range(3)
    ]
    assert out.preempted_handles.tolist() == []
    assert out.finished_handles.tolist() == []
    sched.update_from_output(np.array([50, 51], dtype=np.int32))
    out = sched.schedule()
    assert out.req_handles.tolist() == [h1, h2]
    assert out.is_new.tolist() == [0, 0]
    assert out.input_ids.tolist() == [50, 51]
    assert out.positions.tolist() == [6, 3]
    assert out.num_computed_tokens.tolist() == [6, 3]
    assert out.seq_lens.tolist() == [7, 4]
    up = sched.update_from_output(np.array([60, 61], dtype=np.int32))
    assert up.finish_reasons.tolist() == [FINISH_LENGTH, FINISH_LENGTH]
    assert up.new_token_ids.tolist() == [60, 61]
    out = sched.schedule()
    assert out.num_reqs == 0
    assert out.total_num_scheduled_tokens == 0
    assert out.block_table.shape == (0, 0)
    assert out.query_start_loc.tolist() == [0]
    assert sorted(out.finished_handles.tolist()) == [h1, h2]
    sched.update_from_output(torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize(
    "empty",
    [lambda: np.zeros(0, dtype=np.int32), lambda: np.zeros(0, dtype=np.int64), lambda: np.array([], dtype=np.int32),
     lambda: torch.zeros(0, dtype=torch.int32), lambda: torch.zeros(0, dtype=torch.int64)],
    ids=["numpy-int32", "numpy-int64", "numpy-array", "torch-int32", "torch-int64"],
)
def test_empty_schedule(empty):
    # A step that schedules nothing takes an empty array of sampled tokens, as an engine builds it.
    sched = make_scheduler()
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.num_reqs == 0
    up = sched.update_from_output(empty())
    assert up.req_handles.tolist() == []
    assert up.new_token_offsets.tolist() == [0]


# --- numpy views ------------------------------------------------------------------------------

SCHEDULER_ARRAYS = ["req_handles", "num_scheduled_tokens", "num_computed_tokens", "is_new", "input_ids", "positions",
                    "slot_mapping", "query_start_loc", "seq_lens", "block_table", "logits_indices",
                    "finished_handles", "preempted_handles"]
UPDATE_ARRAYS = ["req_handles", "new_token_offsets", "new_token_ids", "finish_reasons", "stop_reasons"]


def test_output_arrays_are_read_only_views():
    sched = make_scheduler(block_size=4)
    sched.add_request("a", list(range(1, 10)), max_tokens=3)
    sched.add_request("b", list(range(1, 4)), max_tokens=3)
    out = sched.schedule()
    dtypes = {"req_handles": np.int64, "num_scheduled_tokens": np.int32, "num_computed_tokens": np.int32,
              "is_new": np.uint8, "input_ids": np.int32, "positions": np.int32, "slot_mapping": np.int32,
              "query_start_loc": np.int32, "seq_lens": np.int32, "block_table": np.int32,
              "logits_indices": np.int32, "finished_handles": np.int64, "preempted_handles": np.int64}
    for name in SCHEDULER_ARRAYS:
        arr = getattr(out, name)
        assert isinstance(arr, np.ndarray), name
        assert arr.dtype == dtypes[name], name
        assert not arr.flags.writeable, name
        assert arr.flags.c_contiguous, name
        if arr.size:  # (an empty buffer may have no memory to view)
            assert arr.base is not None, f"{name} should be a view of the scheduler's buffer"
            assert not arr.flags.owndata, name
            with pytest.raises(ValueError):
                arr[0] = 1
    # Two reads of a field see the same memory: no copies.
    assert out.input_ids.ctypes.data == out.input_ids.ctypes.data
    assert np.shares_memory(out.positions, out.positions)
    up = sched.update_from_output(np.array([1, 2], dtype=np.int32))
    up_dtypes = {"req_handles": np.int64, "new_token_offsets": np.int32, "new_token_ids": np.int32,
                 "finish_reasons": np.int8, "stop_reasons": np.int32}
    for name in UPDATE_ARRAYS:
        arr = getattr(up, name)
        assert arr.dtype == up_dtypes[name], name
        assert arr.base is not None, name
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[0] = 1
    assert up.new_token_ids.ctypes.data == up.new_token_ids.ctypes.data


def test_handle_lists_are_read_only_views():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    ha = sched.add_request("a", [1, 2, 3, 4], max_tokens=5)
    hb = sched.add_request("b", [5, 6, 7, 8], max_tokens=5)
    preempted = None
    for _ in range(20):
        out = sched.schedule()
        if out.preempted_handles.size:
            preempted = out.preempted_handles
            break
        sched.update_from_output(np.full(out.num_reqs, 9, dtype=np.int32))
    assert preempted is not None
    assert preempted.base is not None and not preempted.flags.writeable
    sched.update_from_output(np.full(out.num_reqs, 9, dtype=np.int32))
    sched.abort_requests(["a", "b"])
    out = sched.schedule()
    finished = out.finished_handles
    assert sorted(finished.tolist()) == sorted([ha, hb])
    assert finished.base is not None and not finished.flags.writeable
    sched.update_from_output(torch.zeros(0, dtype=torch.int32))


def test_views_keep_the_scheduler_alive():
    sched = make_scheduler(block_size=4)
    sched.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], max_tokens=3)
    ids = sched.schedule().input_ids
    del sched
    gc.collect()
    assert ids.tolist() == [3, 1, 4, 1, 5, 9, 2, 6]


def test_views_track_the_scheduler_buffers():
    # The buffers are reserved once, so a view taken in one step shows the next step's data.
    sched = make_scheduler(block_size=4)
    sched.add_request("a", [3, 1, 4, 1, 5], max_tokens=3)
    out = sched.schedule()
    positions = out.positions
    sched.update_from_output(np.array([77], dtype=np.int32))
    out2 = sched.schedule()
    assert out2.positions.ctypes.data == positions.ctypes.data
    assert out2.positions.tolist() == [5]
    assert positions[0] == 5
    sched.update_from_output(np.array([78], dtype=np.int32))


# --- update_from_output input ---------------------------------------------------------------


def _two_running(sched):
    sched.add_request("a", [1, 2, 3], max_tokens=5)
    sched.add_request("b", [4, 5], max_tokens=5)
    return sched.schedule()


@pytest.mark.parametrize(
    "make_tokens",
    [lambda v: np.array(v, dtype=np.int32), lambda v: np.array(v, dtype=np.int64),
     lambda v: torch.tensor(v, dtype=torch.int32), lambda v: torch.tensor(v, dtype=torch.int64)],
    ids=["numpy-int32", "numpy-int64", "torch-int32", "torch-int64"],
)
def test_update_accepts_int32_and_int64(make_tokens):
    sched = make_scheduler()
    _two_running(sched)
    up = sched.update_from_output(make_tokens([123, 456]))
    assert up.new_token_ids.tolist() == [123, 456]
    assert up.new_token_offsets.tolist() == [0, 1, 2]
    sched.schedule()
    up = sched.update_from_output(make_tokens([2**31 - 1, 0]))
    assert up.new_token_ids.tolist() == [2**31 - 1, 0]
    assert sched.request_state(sched.handle_of("a"))["output_token_ids"] == [123, 2**31 - 1]
    assert sched.request_state(sched.handle_of("b"))["output_token_ids"] == [456, 0]


def test_update_accepts_argmax_of_logits():
    sched = make_scheduler()
    _two_running(sched)
    logits = torch.zeros(2, 1000)
    logits[0, 17] = 1.0
    logits[1, 999] = 1.0
    up = sched.update_from_output(torch.argmax(logits, dim=-1))  # int64
    assert up.new_token_ids.tolist() == [17, 999]


@pytest.mark.parametrize(
    "bad, exc",
    [
        (np.array([1, 2, 3], dtype=np.int32), ValueError),  # wrong length
        (np.array([1], dtype=np.int32), ValueError),  # wrong length
        (np.array([1.0, 2.0], dtype=np.float32), TypeError),  # wrong dtype
        (np.array([1, 2], dtype=np.int16), TypeError),  # wrong dtype
        (torch.tensor([1.0, 2.0]), TypeError),  # wrong dtype
        (np.array([[1, 2]], dtype=np.int32), ValueError),  # wrong rank
        (np.array(1, dtype=np.int32), ValueError),  # rank 0
        (np.array([1, 0, 2, 0], dtype=np.int32)[::2], ValueError),  # not contiguous
        ([1, 2], TypeError),  # a list
        ((1, 2), TypeError),  # a tuple
        (None, TypeError),
    ],
    ids=["long", "short", "float32", "int16", "torch-float", "rank2", "rank0", "strided", "list", "tuple", "none"],
)
def test_update_rejects_bad_sampled_tokens(bad, exc):
    sched = make_scheduler()
    _two_running(sched)
    with pytest.raises(exc, match="sampled_token_ids"):
        sched.update_from_output(bad)
    # The failed call changed nothing: the step can still be completed.
    up = sched.update_from_output(np.array([7, 8], dtype=np.int32))
    assert up.new_token_ids.tolist() == [7, 8]


def test_update_before_schedule_raises_runtime_error():
    sched = make_scheduler()
    with pytest.raises(RuntimeError, match="schedule"):
        sched.update_from_output(np.zeros(0, dtype=np.int32))
    _two_running(sched)
    sched.update_from_output(np.array([7, 8], dtype=np.int32))
    with pytest.raises(RuntimeError, match="schedule"):
        sched.update_from_output(np.array([7, 8], dtype=np.int32))


def test_a_second_open_step_takes_only_tokens_no_open_step_holds():
    """Pipeline parallel keeps several steps open: the decodes in flight wait for their tokens,
    a new request joins the second step, and updates close the steps oldest first."""
    sched = make_scheduler()
    ha, hb = _two_running(sched).req_handles.tolist()
    hc = sched.add_request("c", [9, 9, 9], max_tokens=4)
    second = sched.schedule()
    assert second.req_handles.tolist() == [hc]
    assert sched.num_steps_in_flight == 2
    assert sched.schedule().num_reqs == 0 and sched.num_steps_in_flight == 2  # nothing left: no step opened
    first = sched.update_from_output(np.array([7, 8], dtype=np.int32))
    assert first.req_handles.tolist() == [ha, hb]
    assert sched.update_from_output(np.array([5], dtype=np.int32)).req_handles.tolist() == [hc]
    assert not sched.in_step


def test_update_with_offsets():
    sched = make_scheduler()
    ha = sched.add_request("a", [1, 2, 3], max_tokens=3, stop_token_ids=[99])
    hb = sched.add_request("b", [4, 5], max_tokens=10, stop_token_ids=[99])
    hc = sched.add_request("c", [6], max_tokens=10, stop_token_ids=[99])
    sched.schedule()
    # a: four tokens but max_tokens=3 -> the fourth is dropped; b: stops at 99; c: none.
    up = sched.update_from_output(np.array([10, 11, 12, 13, 20, 99, 21], dtype=np.int32),
                                  np.array([0, 4, 7, 7], dtype=np.int32))
    assert up.req_handles.tolist() == [ha, hb, hc]
    assert up.new_token_offsets.tolist() == [0, 3, 5, 5]
    assert up.new_token_ids.tolist() == [10, 11, 12, 20, 99]
    assert up.finish_reasons.tolist() == [FINISH_LENGTH, FINISH_STOP, FINISH_RUNNING]
    assert up.stop_reasons.tolist() == [-1, 99, -1]
    assert sched.running_handles() == [hc]


def test_update_rejects_bad_offsets():
    sched = make_scheduler()
    _two_running(sched)
    tokens = np.array([1, 2], dtype=np.int32)
    with pytest.raises(ValueError, match="offsets"):
        sched.update_from_output(tokens, np.array([1, 1, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="offsets"):
        sched.update_from_output(tokens, np.array([0, 2, 1], dtype=np.int32))
    with pytest.raises(ValueError, match="offsets"):
        sched.update_from_output(tokens, np.array([0, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.update_from_output(tokens, np.array([0, 1, 3], dtype=np.int32))
    up = sched.update_from_output(tokens, np.array([0, 1, 2], dtype=np.int64))
    assert up.new_token_ids.tolist() == [1, 2]


# --- chunked prefill --------------------------------------------------------------------------


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=32)
    d = Driver(sched)
    h = d.add("long", range(1000, 1100), max_tokens=3)
    chunks = []
    for _ in range(4):
        b = d.step()
        assert b["req_handles"] == [h]
        chunks.append((b["num_computed_tokens"][0], b["num_scheduled_tokens"][0], b["is_new"][0]))
        state = sched.request_state(h)
        assert state["num_computed_tokens"] == chunks[-1][0] + chunks[-1][1]
    assert chunks == [(0, 32, 1), (32, 32, 0), (64, 32, 0), (96, 4, 0)]
    # No output until the last chunk.
    assert [len(s["finish_reasons"]) for s in d.steps] == [1, 1, 1, 1]
    assert len(d.outputs[h]) == 1
    d.run()
    assert len(d.outputs[h]) == 3
    assert_all_free(sched)


def test_chunked_prefill_shares_the_budget_with_decodes():
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=20)
    d = Driver(sched)
    ha = d.add("a", range(1, 6), max_tokens=20)
    d.step()
    hb = d.add("b", range(100, 150), max_tokens=2)
    b = d.step()
    # The running decode comes first and the prefill chunk takes the rest of the budget.
    assert b["req_handles"] == [ha, hb]
    assert b["num_scheduled_tokens"] == [1, 19]
    b = d.step()
    assert b["num_scheduled_tokens"] == [1, 19]
    b = d.step()
    assert b["num_scheduled_tokens"] == [1, 12]
    d.run()
    assert len(d.outputs[ha]) == 20 and len(d.outputs[hb]) == 2


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=512, long_prefill_token_threshold=24)
    d = Driver(sched)
    h = d.add("a", range(1, 61), max_tokens=2)
    sizes = []
    while len(d.outputs[h]) == 0:
        sizes.append(d.step()["num_scheduled_tokens"][0])
    assert sizes == [24, 24, 12]
    d.run()


def test_without_chunked_prefill_prompts_are_never_split():
    sched = make_scheduler(num_blocks=64, block_size=16, max_model_len=128, max_num_batched_tokens=128,
                           enable_chunked_prefill=False)
    d = Driver(sched)
    h1 = d.add("a", range(1, 101), max_tokens=4)
    h2 = d.add("b", range(200, 300), max_tokens=4)
    b = d.step()
    assert b["req_handles"] == [h1]
    assert b["num_scheduled_tokens"] == [100]
    b = d.step()
    assert b["req_handles"] == [h1, h2]
    assert b["num_scheduled_tokens"] == [1, 100]
    d.run()
    for b in d.steps:
        # Every scheduled request computes all of its known tokens: no partial prefill.
        assert [c + n for c, n in zip(b["num_computed_tokens"], b["num_scheduled_tokens"])] == b["num_tokens"]
    assert len(d.outputs[h1]) == 4 and len(d.outputs[h2]) == 4


def test_with_chunked_prefill_the_second_prompt_starts_at_once():
    sched = make_scheduler(num_blocks=64, block_size=16, max_model_len=128, max_num_batched_tokens=128)
    d = Driver(sched)
    h1 = d.add("a", range(1, 101), max_tokens=4)
    h2 = d.add("b", range(200, 300), max_tokens=4)
    b = d.step()
    assert b["req_handles"] == [h1, h2]
    assert b["num_scheduled_tokens"] == [100, 28]
    d.run()


def test_without_chunked_prefill_the_long_prefill_threshold_does_not_split_prompts():
    # Either the configuration is refused, or prompts still run in one step.
    try:
        cfg = _C.SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                                 enable_chunked_prefill=False, long_prefill_token_threshold=4)
    except ValueError as e:
        assert "long_prefill_token_threshold" in str(e)
        return
    sched = _C.Scheduler(cfg)
    d = Driver(sched)
    d.add("a", range(1, 11), max_tokens=2)
    b = d.step()
    assert b["num_scheduled_tokens"] == [10], "a prompt was split although chunked prefill is disabled"
    d.run()


def test_chunked_prefill_disabled_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _C.SchedulerConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=128, enable_chunked_prefill=False)


def test_max_num_partial_prefills():
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=40, max_num_partial_prefills=1)
    d = Driver(sched)
    h1 = d.add("a", range(1, 31), max_tokens=2)
    h2 = d.add("b", range(100, 130), max_tokens=2)
    b = d.step()
    # a fits entirely; b would be a partial prefill and a is not partial, so b starts.
    assert b["req_handles"] == [h1, h2]
    assert b["num_scheduled_tokens"] == [30, 10]
    d.run()

    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=40, max_num_partial_prefills=1)
    d = Driver(sched)
    h1 = d.add("a", range(1, 61), max_tokens=2)
    h2 = d.add("b", range(100, 130), max_tokens=2)
    b = d.step()
    assert b["req_handles"] == [h1]  # a is mid-prefill: b may not start another partial prefill
    b = d.step()
    assert b["req_handles"] == [h1, h2]
    assert b["num_scheduled_tokens"] == [20, 20]
    d.run()


# --- max_num_seqs -----------------------------------------------------------------------------


def test_max_num_seqs_is_respected():
    sched = make_scheduler(num_blocks=128, block_size=4, max_num_seqs=3)
    d = Driver(sched)
    for i in range(8):
        d.add(f"r{i}", range(10 * i + 1, 10 * i + 6), max_tokens=3 + i % 3)
    max_seen = 0
    while sched.has_unfinished_requests():
        b = d.step()
        assert len(b["req_handles"]) <= 3
        assert sched.num_running <= 3
        assert len(sched.running_handles()) == sched.num_running
        assert len(sched.waiting_handles()) == sched.num_waiting
        max_seen = max(max_seen, len(b["req_handles"]))
    assert max_seen == 3
    assert all(len(d.outputs[d.handle[f"r{i}"]]) == 3 + i % 3 for i in range(8))
    # FCFS: requests start in arrival order.
    first_step = {}
    for k, b in enumerate(d.steps):
        for h, new in zip(b["req_handles"], b["is_new"]):
            if new:
                first_step.setdefault(h, k)
    order = sorted(first_step, key=lambda h: (first_step[h], h))
    assert order == sorted(order)


# --- prefix cache -----------------------------------------------------------------------------


def test_second_request_with_same_prompt_hits_the_cache():
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    prompt = list(range(500, 580))  # 80 tokens = 5 blocks
    d.add("a", prompt, max_tokens=2)
    d.run()
    stats0 = dict(sched.prefix_cache_stats)
    assert stats0["requests"] == 1 and stats0["queries"] == 80 and stats0["hits"] == 0
    h = d.add("b", prompt, max_tokens=2)
    b = d.step()
    # 80 tokens are fully cached, but the last one is recomputed: four blocks hit.
    assert b["num_computed_tokens"] == [64]
    assert b["num_scheduled_tokens"] == [16]
    stats1 = sched.prefix_cache_stats
    assert stats1["requests"] == 2
    assert stats1["queries"] == 160
    assert stats1["hits"] == 64
    d.run()
    assert len(d.outputs[h]) == 2


def test_cache_hit_while_the_first_request_still_runs():
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    prompt = list(range(500, 550))
    ha = d.add("a", prompt, max_tokens=10)
    d.step()
    hb = d.add("b", prompt + [1, 2, 3], max_tokens=10)
    b = d.step()
    assert b["req_handles"] == [ha, hb]
    assert b["num_computed_tokens"][1] == 48
    blocks_a = sched.request_state(ha)["block_ids"]
    blocks_b = sched.request_state(hb)["block_ids"]
    assert blocks_a[:3] == blocks_b[:3]
    assert blocks_a[3] != blocks_b[3]
    refs = sched.block_ref_counts()
    assert all(refs[blk] == 2 for blk in blocks_a[:3])
    d.run()
    assert_all_free(sched)


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 4])
def test_last_prompt_token_is_recomputed_on_a_full_hit(num_blocks_in_prompt):
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    prompt = list(range(700, 700 + 16 * num_blocks_in_prompt))
    d.add("a", prompt, max_tokens=1)
    d.run()
    h = d.add("b", prompt, max_tokens=3)
    b = d.step()
    # Every block is cached, yet the last block is computed again for the last token's logits.
    assert b["num_computed_tokens"] == [16 * (num_blocks_in_prompt - 1)]
    assert b["num_scheduled_tokens"] == [16]
    assert len(d.outputs[h]) == 1
    d.run()


def test_single_token_prompt_never_hits():
    sched = make_scheduler(num_blocks=16, block_size=1, max_model_len=64, max_num_batched_tokens=64)
    d = Driver(sched)
    d.add("a", [42], max_tokens=2)
    d.run()
    d.add("b", [42], max_tokens=2)
    b = d.step()
    assert b["num_computed_tokens"] == [0] and b["num_scheduled_tokens"] == [1]
    d.run()


def test_follow_up_request_hits_the_blocks_of_the_answer():
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    prompt = list(range(300, 340))  # 40 tokens
    ha = d.add("turn1", prompt, max_tokens=30)
    d.run()
    answer = d.outputs[ha]
    assert len(answer) == 30
    # 70 tokens, the last one never fed back: 69 have KV, 4 full blocks = 64 tokens cached, and
    # the 5 of the last block as a partial block, which the follow-up copies.
    follow_up = prompt + answer + [1, 2, 3, 4, 5]
    hits0 = sched.prefix_cache_stats["hits"]
    hb = d.add("turn2", follow_up, max_tokens=2)
    b = d.step()
    assert b["num_computed_tokens"] == [69]
    assert b["num_computed_tokens"][0] > len(prompt)  # the answer's blocks hit too
    assert sched.prefix_cache_stats["hits"] - hits0 == 69
    assert b["num_scheduled_tokens"] == [len(follow_up) - 69]
    d.run()
    assert len(d.outputs[hb]) == 2


def test_divergent_prompt_hits_only_the_common_blocks():
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    common = list(range(10, 42))  # two blocks
    d.add("a", common + list(range(100, 120)), max_tokens=1)
    d.run()
    d.add("b", common + list(range(200, 220)), max_tokens=1)
    assert d.step()["num_computed_tokens"] == [32]
    # A change inside the first block: nothing hits, even though the second block matches.
    changed = [999] + common[1:] + list(range(100, 120))
    d.add("c", changed, max_tokens=1)
    assert d.step()["num_computed_tokens"] == [0]


def test_cache_extra_key_isolates_prefixes():
    sched = make_scheduler(num_blocks=64, block_size=16)
    d = Driver(sched)
    prompt = list(range(800, 850))
    d.add("a", prompt, max_tokens=1, cache_extra_key=0)
    d.run()
    d.add("b", prompt, max_tokens=1, cache_extra_key=12345)
    assert d.step()["num_computed_tokens"] == [0]
    d.add("c", prompt, max_tokens=1, cache_extra_key=12345)
    assert d.step()["num_computed_tokens"] == [48]
    d.add("d", prompt, max_tokens=1)  # default key 0
    assert d.step()["num_computed_tokens"] == [48]
    d.add("e", prompt, max_tokens=1, cache_extra_key=2**64 - 1)
    assert d.step()["num_computed_tokens"] == [0]


def test_prefix_caching_disabled():
    sched = make_scheduler(num_blocks=64, block_size=16, enable_prefix_caching=False)
    d = Driver(sched)
    prompt = list(range(800, 850))
    d.add("a", prompt, max_tokens=1)
    d.run()
    assert sched.block_pool.num_cached_blocks == 0
    d.add("b", prompt, max_tokens=1)
    assert d.step()["num_computed_tokens"] == [0]
    assert sched.prefix_cache_stats["hits"] == 0


# --- stop rules -------------------------------------------------------------------------------


def scripted(script):
    """A sampler that plays script[i] for a request's i-th output, then 5."""
    return lambda h, n: script[n] if n < len(script) else 5


def test_stop_token():
    sched = make_scheduler()
    d = Driver(sched, scripted([11, 12, 42, 13]))
    h = d.add("a", [1, 2, 3], max_tokens=10, stop_token_ids=[41, 42])
    d.run()
    assert d.outputs[h] == [11, 12, 42]
    assert d.finish_reason[h] == FINISH_STOP
    assert d.stop_reason[h] == 42
    assert_all_free(sched)


def test_eos_token():
    sched = make_scheduler()
    d = Driver(sched, scripted([11, 2, 13]))
    h = d.add("a", [1, 2, 3], max_tokens=10, eos_token_id=2)
    d.run()
    assert d.outputs[h] == [11, 2]
    assert d.finish_reason[h] == FINISH_STOP
    assert d.stop_reason[h] == -1  # eos is not a stop token


def test_eos_ignored_with_ignore_eos():
    sched = make_scheduler()
    d = Driver(sched, lambda h, n: 2)
    h = d.add("a", [1, 2, 3], max_tokens=6, eos_token_id=2, ignore_eos=True)
    d.run()
    assert d.outputs[h] == [2] * 6
    assert d.finish_reason[h] == FINISH_LENGTH


def test_ignore_eos_keeps_stop_tokens():
    sched = make_scheduler()
    d = Driver(sched, scripted([2, 2, 9]))
    h = d.add("a", [1], max_tokens=6, eos_token_id=2, ignore_eos=True, stop_token_ids=[9])
    d.run()
    assert d.outputs[h] == [2, 2, 9]
    assert d.finish_reason[h] == FINISH_STOP and d.stop_reason[h] == 9


def test_min_tokens_delays_eos_and_stop_tokens():
    sched = make_scheduler()
    d = Driver(sched, lambda h, n: 2)
    h = d.add("a", [1, 2, 3], max_tokens=10, min_tokens=4, eos_token_id=2)
    d.run()
    assert d.outputs[h] == [2, 2, 2, 2]
    assert d.finish_reason[h] == FINISH_STOP

    d = Driver(sched, lambda h, n: 7)
    h = d.add("b", [1, 2, 3], max_tokens=10, min_tokens=3, stop_token_ids=[7])
    d.run()
    assert d.outputs[h] == [7, 7, 7]
    assert d.finish_reason[h] == FINISH_STOP and d.stop_reason[h] == 7


def test_length():
    sched = make_scheduler()
    d = Driver(sched)
    h = d.add("a", [1, 2, 3], max_tokens=5, eos_token_id=2, stop_token_ids=[3])
    h1 = d.add("b", [1, 2, 3], max_tokens=1)
    d.run()
    assert len(d.outputs[h]) == 5 and d.finish_reason[h] == FINISH_LENGTH and d.stop_reason[h] == -1
    assert len(d.outputs[h1]) == 1 and d.finish_reason[h1] == FINISH_LENGTH


def test_max_model_len_ends_a_request():
    sched = make_scheduler(block_size=4, max_model_len=16, max_num_batched_tokens=16)
    d = Driver(sched)
    h = d.add("a", list(range(1, 11)), max_tokens=100)
    d.run()
    assert len(d.outputs[h]) == 6  # 10 + 6 = max_model_len
    assert d.finish_reason[h] == FINISH_LENGTH
    assert max(max(s["num_computed_tokens"][i] + s["num_scheduled_tokens"][i] for i in range(len(s["req_handles"])))
               for s in d.steps) <= 15


def test_finished_handles_reported_in_the_next_step():
    sched = make_scheduler()
    d = Driver(sched)
    ha = d.add("a", [1, 2], max_tokens=1)
    hb = d.add("b", [3, 4], max_tokens=3)
    b = d.step()
    assert b["finish_reasons"] == [FINISH_LENGTH, FINISH_RUNNING]
    b = d.step()
    assert b["finished"] == [ha]
    assert b["req_handles"] == [hb]
    b = d.step()
    assert b["finished"] == []


# --- abort ------------------------------------------------------------------------------------


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    d = Driver(sched)
    ha = d.add("a", [1, 2, 3], max_tokens=5)
    hb = d.add("b", [4, 5, 6], max_tokens=5)
    d.step()
    assert sched.waiting_handles() == [hb]
    sched.abort_requests(["b"])
    assert sched.waiting_handles() == []
    assert sched.request_state(hb) is None
    assert sched.handle_of("b") is None
    b = d.step()
    assert b["finished"] == [hb]
    assert b["req_handles"] == [ha]
    d.run()
    assert_all_free(sched)


def test_abort_running_request_frees_its_blocks():
    sched = make_scheduler(num_blocks=32, block_size=4)
    d = Driver(sched)
    ha = d.add("a", list(range(1, 20)), max_tokens=10)
    hb = d.add("b", list(range(21, 30)), max_tokens=10)
    d.step()
    d.step()
    used = sched.block_pool.num_used_blocks
    a_blocks = sched.request_state(ha)["block_ids"]
    assert used == len(a_blocks) + len(sched.request_state(hb)["block_ids"])
    sched.abort_requests(["a", "no-such-request"])
    assert sched.block_pool.num_used_blocks == used - len(a_blocks)
    assert all(sched.block_ref_counts()[blk] == 0 for blk in a_blocks)
    assert sched.running_handles() == [hb]
    assert sched.request_state(ha) is None
    b = d.step()
    assert b["finished"] == [ha]
    assert b["req_handles"] == [hb]
    sched.abort_requests(["a"])  # already finished: ignored
    d.run()
    assert_all_free(sched)


def test_abort_between_schedule_and_update_is_deferred():
    sched = make_scheduler(num_blocks=32, block_size=4)
    ha = sched.add_request("a", list(range(1, 10)), max_tokens=10)
    hb = sched.add_request("b", list(range(11, 20)), max_tokens=10)
    sched.schedule()
    sched.update_from_output(np.array([1, 2], dtype=np.int32))
    out = sched.schedule()
    assert out.req_handles.tolist() == [ha, hb]
    blocks = sched.request_state(ha)["block_ids"]
    used = sched.block_pool.num_used_blocks
    sched.abort_requests(["a"])
    # Still alive until the update: this step's KV writes must stay valid.
    assert sched.request_state(ha) is not None
    assert sched.block_pool.num_used_blocks == used
    assert all(sched.block_ref_counts()[blk] >= 1 for blk in blocks)
    up = sched.update_from_output(np.array([3, 4], dtype=np.int32))
    assert up.req_handles.tolist() == [ha, hb]
    assert sched.request_state(ha) is None
    assert sched.running_handles() == [hb]
    assert sched.block_pool.num_used_blocks == used - len(blocks)
    out = sched.schedule()
    assert out.finished_handles.tolist() == [ha]
    assert out.req_handles.tolist() == [hb]
    sched.update_from_output(np.array([5], dtype=np.int32))
    sched.abort_requests(["b"])
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)


def test_abort_of_request_that_stops_in_the_same_step():
    sched = make_scheduler()
    ha = sched.add_request("a", [1, 2, 3], max_tokens=1)
    sched.schedule()
    sched.abort_requests(["a"])
    up = sched.update_from_output(np.array([9], dtype=np.int32))
    assert up.finish_reasons.tolist() == [FINISH_LENGTH]  # it finished normally first
    out = sched.schedule()
    assert out.finished_handles.tolist() == [ha]
    sched.update_from_output(torch.zeros(0, dtype=torch.int32))
    assert_all_free(sched)


def test_aborted_id_can_be_reused():
    sched = make_scheduler()
    h1 = sched.add_request("a", [1, 2, 3], max_tokens=5)
    sched.abort_requests(["a"])
    h2 = sched.add_request("a", [1, 2, 3], max_tokens=5)
    assert h2 != h1
    assert sched.handle_of("a") == h2


# --- preemption -------------------------------------------------------------------------------


def _preemption_workload(policy, priorities):
    # 6 usable blocks of 4 tokens; each request grows to 4 + 8 - 1 = 11 tokens = 3 blocks.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64, max_num_batched_tokens=64, policy=policy)
    d = Driver(sched)
    arrival = {}
    for i, prio in enumerate(priorities):
        h = d.add(f"r{i}", [100 * (i + 1) + k for k in range(4)], max_tokens=8, priority=prio)
        arrival[h] = i
    return sched, d, arrival


def _run_checking_victims(sched, d, key):
    preempted = []
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        running_before = sched.running_handles()
        b = d.step()
        if b["preempted"]:
            expected = sorted(running_before, key=key, reverse=True)[: len(b["preempted"])]
            assert b["preempted"] == expected, (running_before, b["preempted"])
            for h in b["preempted"]:
                assert h not in b["req_handles"]
                state = sched.request_state(h)
                assert state["status"] == "preempted"
                assert state["block_ids"] == []
                assert state["num_computed_tokens"] == 0
            preempted += b["preempted"]
        pool = sched.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks - 1
    assert not sched.has_unfinished_requests()
    return preempted


def test_preemption_fcfs_evicts_the_latest_arrival():
    sched, d, arrival = _preemption_workload("fcfs", [0, 0, 0])
    preempted = _run_checking_victims(sched, d, key=lambda h: arrival[h])
    assert preempted, "the pool is too small for all three: something must be preempted"
    assert sched.num_preemptions == len(preempted)
    # The first victim is the last request to arrive.
    assert preempted[0] == max(arrival, key=arrival.get)
    for h in arrival:
        assert len(d.outputs[h]) == 8
        assert d.finish_reason[h] == FINISH_LENGTH
    assert_all_free(sched)


def test_preemption_priority_evicts_the_largest_priority_value():
    # r1 has the largest priority value (served last), though r2 arrived later.
    sched, d, arrival = _preemption_workload("priority", [0, 5, 1])
    prio = {h: [0, 5, 1][arrival[h]] for h in arrival}
    preempted = _run_checking_victims(sched, d, key=lambda h: (prio[h], arrival[h]))
    assert preempted
    assert preempted[0] == d.handle["r1"]
    for h in arrival:
        assert len(d.outputs[h]) == 8
        assert d.finish_reason[h] == FINISH_LENGTH
    assert_all_free(sched)


def test_preempted_request_resumes_with_its_outputs():
    sched, d, arrival = _preemption_workload("fcfs", [0, 0, 0])
    resumed = set()
    preempted = set()
    while sched.has_unfinished_requests():
        b = d.step()
        preempted |= set(b["preempted"])
        for h, new, comp, n in zip(b["req_handles"], b["is_new"], b["num_computed_tokens"], b["num_scheduled_tokens"]):
            if h in preempted and new:
                resumed.add(h)
                # Resumed: recomputes prompt + outputs so far (from a prefix-cache hit or from 0).
                assert comp % 4 == 0
                assert comp + n <= len(d.tokens[h])
    assert resumed and resumed <= preempted
    # The outputs are exactly what the sampler produced, in order, despite the recompute.
    for h in arrival:
        assert d.outputs[h] == [default_sample(h, k) for k in range(8)]


def test_priority_waiting_queue_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1, policy="priority")
    d = Driver(sched)
    h0 = d.add("first", [1], max_tokens=1, priority=3)
    h_low = d.add("low", [2], max_tokens=1, priority=9)
    h_high = d.add("high", [3], max_tokens=1, priority=-1)
    h_mid = d.add("mid", [4], max_tokens=1, priority=3)
    order = []
    while sched.has_unfinished_requests():
        order += d.step()["req_handles"]
    assert order == [h_high, h0, h_mid, h_low]


def test_priority_ties_are_broken_by_arrival_time_then_add_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1, policy="priority")
    d = Driver(sched)
    ha = d.add("a", [1], max_tokens=1, priority=1, arrival_time=5.0)
    hb = d.add("b", [2], max_tokens=1, priority=1, arrival_time=1.0)
    hc = d.add("c", [3], max_tokens=1, priority=1, arrival_time=1.0)
    he = d.add("e", [4], max_tokens=1, priority=0, arrival_time=9.0)
    order = []
    while sched.has_unfinished_requests():
        order += d.step()["req_handles"]
    assert order == [he, hb, hc, ha]


def test_fcfs_ignores_arrival_time():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    d = Driver(sched)
    ha = d.add("a", [1], max_tokens=1, arrival_time=5.0)
    hb = d.add("b", [2], max_tokens=1, arrival_time=1.0)
    order = []
    while sched.has_unfinished_requests():
        order += d.step()["req_handles"]
    assert order == [ha, hb]


def test_priority_victim_is_the_latest_arrival_time_among_equal_priorities():
    # Same priority: the request that arrived last (by arrival_time) is preempted first.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64, max_num_batched_tokens=64, policy="priority")
    d = Driver(sched)
    h_late = d.add("late", [1, 2, 3, 4], max_tokens=8, arrival_time=10.0)
    d.add("early", [5, 6, 7, 8], max_tokens=8, arrival_time=1.0)
    d.add("mid", [9, 10, 11, 12], max_tokens=8, arrival_time=5.0)
    victims = []
    while sched.has_unfinished_requests():
        victims += d.step()["preempted"]
    assert victims and victims[0] == h_late
    assert all(len(o) == 8 for o in d.outputs.values())


def test_bad_policy_name():
    with pytest.raises(ValueError, match="policy"):
        _C.SchedulerConfig(num_blocks=8, policy="lifo")
    assert _C.SchedulerConfig(num_blocks=8, policy="priority").policy == "priority"
    assert _C.SchedulerConfig(num_blocks=8).policy == "fcfs"


# --- add_request validation -------------------------------------------------------------------


def test_add_request_rejections():
    sched = make_scheduler(num_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request("e", [], max_tokens=4)
    sched.add_request("dup", [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("dup", [4, 5, 6], max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request("long", list(range(256)), max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request("longer", list(range(300)), max_tokens=1)
    sched.add_request("fits-len", list(range(255)), max_tokens=1)  # the longest prompt allowed
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request("zero", [1], max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        sched.add_request("min", [1], max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="min_tokens"):
        sched.add_request("neg-min", [1], max_tokens=2, min_tokens=-1)
    assert sorted(sched.waiting_handles()) == sorted([sched.handle_of("dup"), sched.handle_of("fits-len")])


def test_add_request_rejects_what_the_pool_can_never_hold():
    # 8 usable blocks of 16 tokens = 128 KV slots; the last output token needs no slot.
    sched = make_scheduler(num_blocks=9, block_size=16, max_model_len=1024, max_num_batched_tokens=1024)
    sched.add_request("ok", list(range(100)), max_tokens=29)  # 128 tokens, 127 slots
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request("too-big", list(range(100)), max_tokens=30)  # 129 slots
    with pytest.raises(ValueError, match="too-big2"):
        sched.add_request("too-big2", list(range(200)), max_tokens=1)
    assert sched.handle_of("too-big") is None
    assert sched.num_waiting == 1


def test_add_request_pool_check_uses_max_model_len():
    # max_tokens far beyond the model length is fine when max_model_len bounds the request.
    sched = make_scheduler(num_blocks=5, block_size=16, max_model_len=64, max_num_batched_tokens=64)
    d = Driver(sched)
    h = d.add("a", list(range(10)), max_tokens=10**6)
    d.run()
    assert len(d.outputs[h]) == 54
    assert d.finish_reason[h] == FINISH_LENGTH


def test_add_request_defaults_and_state():
    sched = make_scheduler(block_size=4)
    h = sched.add_request("a", [7, 8, 9])
    assert sched.handle_of("a") == h
    assert sched.handle_of("missing") is None
    state = sched.request_state(h)
    assert state["request_id"] == "a"
    assert state["status"] == "waiting"
    assert state["num_computed_tokens"] == 0
    assert state["num_prompt_tokens"] == 3
    assert state["output_token_ids"] == []
    assert state["block_ids"] == []
    assert state["num_preemptions"] == 0
    assert sched.request_state(12345) is None
    d = Driver(sched)
    d.tokens[h], d.outputs[h] = [7, 8, 9], []
    d.run()
    assert len(d.outputs[h]) == 16  # default max_tokens


def test_config_is_readable():
    cfg = _C.SchedulerConfig(num_blocks=10, block_size=8, max_model_len=512, max_num_seqs=4,
                             max_num_batched_tokens=128, long_prefill_token_threshold=32, num_lookahead_tokens=2)
    assert (cfg.num_blocks, cfg.block_size, cfg.max_model_len, cfg.max_num_seqs) == (10, 8, 512, 4)
    assert (cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold, cfg.num_lookahead_tokens) == (128, 32, 2)
    assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching
    sched = _C.Scheduler(cfg)
    assert sched.config.max_num_seqs == 4
    for bad in [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_model_len=1),
                dict(num_lookahead_tokens=-1), dict(long_prefill_token_threshold=-1),
                dict(max_num_partial_prefills=-1)]:
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            _C.SchedulerConfig(num_blocks=10, **bad)


def test_lookahead_slots_are_reserved():
    sched = make_scheduler(num_blocks=64, block_size=4, num_lookahead_tokens=5)
    h = sched.add_request("a", [1, 2, 3], max_tokens=4)
    out = sched.schedule()
    # 3 tokens + 5 lookahead slots = 8 slots = 2 blocks.
    assert len(sched.request_state(h)["block_ids"]) == 2
    assert out.block_table.shape == (1, 2)
    sched.update_from_output(np.array([1], dtype=np.int32))
