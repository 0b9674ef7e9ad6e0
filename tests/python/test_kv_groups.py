"""KV cache groups of hybrid models: how layers are grouped, the KV a long request holds against
full attention on every layer (measured on the native scheduler), and the front end's admission
rule agreeing with the scheduler's."""

from __future__ import annotations

import numpy as np
import pytest

from octavo import _C
from octavo.kv_groups import plan_kv_groups

# Gemma 3 270M: 18 layers, every 6th with full attention, the others a 512-token window.
GEMMA3_270M = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]


def test_one_kind_of_layer_makes_one_group():
    for windows in ([0] * 4, [256] * 4, [128, 256]):  # all full; all sliding; no full layer to anchor hits
        groups = plan_kv_groups(windows)
        assert groups.windows == (0,) and groups.layers == (tuple(range(len(windows))),)
        assert not groups.hybrid and groups.scheduler_windows() == []


def test_hybrid_layers_make_equal_groups_full_first():
    groups = plan_kv_groups(GEMMA3_270M)
    assert groups.windows == (0, 512, 512, 512, 512, 512) and groups.size == 3
    assert groups.layers[0] == (5, 11, 17)
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    # Gemma 3 1B: 26 layers, 4 full: groups of gcd(4, 22) = 2.
    one_b = plan_kv_groups([0 if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert one_b.size == 2 and one_b.windows.count(0) == 2 and len(one_b.windows) == 13
    mixed = plan_kv_groups([0, 8, 16, 8, 0, 16])
    assert mixed.windows == (0, 8, 16) and mixed.layers == ((0, 4), (1, 3), (2, 5))
    assert sorted(i for layers in mixed.layers for i in layers) == list(range(6))


def test_gemma3_holds_under_a_third_of_full_attention_at_8k():
    groups = plan_kv_groups(GEMMA3_270M)
    # (3 full layers x 512 blocks + 15 sliding x 32) / (18 x 512)
    assert groups.kv_fraction(8192, 16) == pytest.approx((512 + 5 * 32) / (6 * 512))
    assert groups.kv_fraction(8192, 16) <= 0.35
    assert "1 full + 5 sliding (window 512) group(s) of 3 layer(s)" == groups.describe()


def test_the_scheduler_holds_what_the_groups_say():
    """An 8k prompt through the native scheduler in 2048-token chunks, then decode steps: the
    blocks it holds are the plan's, and under 0.35 of six groups of full attention."""
    groups, bs = plan_kv_groups(GEMMA3_270M), 16
    sched = _C.Scheduler(_C.SchedulerConfig(num_blocks=4000, block_size=bs, max_model_len=8300,
                                            max_num_batched_tokens=2048, kv_group_windows=groups.scheduler_windows()))
    handle = sched.add_request("long", [7] * 8192, max_tokens=8)
    held = []
    for _ in range(4 + 6):
        out = sched.schedule()
        state = sched.request_state(handle)
        tables = [state["block_ids"]] + state["group_block_ids"]
        held.append((int(out.seq_lens[0]), sum(b != 0 for t in tables for b in t)))
        assert out.group_block_tables.shape == (5, 1, len(state["block_ids"]))
        sched.update_from_output(np.array([11], dtype=np.int32))
    for seq_len, blocks in held[4:]:  # decode steps: the newest token at seq_len - 1
        assert blocks == groups.blocks_held(seq_len, bs)
        assert blocks / (6 * -(-seq_len // bs)) <= 0.35
    assert sched.block_pool.num_used_blocks == held[-1][1]


@pytest.mark.parametrize("windows", [[], [0, 512, 512], [0, 20, 0, 64]])
def test_admission_rule_is_the_schedulers(windows):
    """The front end's check (max_kv_blocks_per_request) refuses exactly what add_request would."""
    bs, budget = 16, 256
    for num_blocks in (40, 64, 100):
        sched = _C.Scheduler(_C.SchedulerConfig(num_blocks=num_blocks, block_size=bs, max_model_len=4096,
                                                max_num_batched_tokens=budget, kv_group_windows=windows))
        for prompt_len in (100, 500, 700, 1000, 2000):
            needed = _C.max_kv_blocks_per_request(prompt_len + 4 - 1, bs, windows, budget)
            fits = needed <= num_blocks - 1
            try:
                sched.add_request(f"r{num_blocks}-{prompt_len}", [1] * prompt_len, max_tokens=4)
                assert fits, (num_blocks, prompt_len, needed)
            except ValueError:
                assert not fits, (num_blocks, prompt_len, needed)


def test_bad_group_windows_are_refused():
    with pytest.raises(ValueError, match="kv_group_windows"):
        _C.SchedulerConfig(num_blocks=8, kv_group_windows=[16, 0])
    with pytest.raises(ValueError, match="kv_group_windows"):
        _C.SchedulerConfig(num_blocks=8, kv_group_windows=[0, -3])
