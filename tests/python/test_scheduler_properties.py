"""Property test of the scheduler: random workloads, invariants checked after every step.

Each example draws a configuration (block size, a pool small enough to force preemption, token
budget, both policies, chunked prefill on or off, prefix caching on or off) and a workload
(prompts built from a few shared prefixes plus random tails, random stop tokens and eos, aborts at
random steps, requests arriving at random steps), then runs it to completion with a
deterministic sampler, checking the pool and the batch after every schedule() and update.
With speculation drawn on, decoding requests get draft tokens after every update (the sampler's
own next tokens with some made wrong, or prompt-lookup drafts), verified as a rejection sampler
would: the outputs must be the sampler's, whatever was accepted.
"""

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo import _C
from octavo.worker.gpu_memory import step_limits

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
VOCAB = 12  # prompt tokens: small, so that different prompts share identical blocks
SAMPLE_VOCAB = 32  # sampled tokens: eos / stop tokens (all below VOCAB) come up now and then


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 48))
    else:
        budget = max_model_len + draw(st.integers(0, 32))
    cfg = dict(
        block_size=bs,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        max_num_partial_prefills=draw(st.integers(0, 3)),
        # (a per-step cap that splits prompts: it must not apply without chunked prefill)
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 0, 1, 5, 16])),
        num_lookahead_tokens=draw(st.sampled_from([0, 0, 0, 1, 3])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        # Hybrid models: KV groups of full (0) and sliding-window attention (None: a window drawn).
        kv_group_windows=[w if w is not None else draw(st.integers(1, 24))
                          for w in draw(st.sampled_from([[], [], [], [0, None], [0, None, 0], [0, None, None]]))],
    )
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), min_size=1, max_size=3))
    n = draw(st.integers(1, 10))
    requests = []
    arrival_step = 0
    for i in range(n):
        arrival_step += draw(st.sampled_from([0, 0, 0, 1, 2, 5]))
        prompt = []
        if draw(st.booleans()):
            prompt = list(draw(st.sampled_from(prefixes)))
        prompt += draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prompt else 1, max_size=30))
        prompt = prompt[: max_model_len - 1]
        max_tokens = draw(st.integers(1, 24))
        stop_ids = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))
        abort = draw(st.sampled_from([None] * 6 + ["before", "during"]))
        requests.append(dict(
            request_id=f"req-{i}",
            prompt=prompt,
            arrival_step=arrival_step,
            # usually the step, sometimes out of order (it breaks priority ties)
            arrival_time=float(arrival_step + draw(st.sampled_from([0, 0, 0, -3, 4]))),
            add_during_step=draw(st.sampled_from([False, False, False, True])),
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(max_tokens, 4))),
            eos_token_id=draw(st.sampled_from([-1, 0, 1])),
            stop_token_ids=stop_ids,
            ignore_eos=draw(st.booleans()),
            priority=draw(st.integers(-2, 2)),
            cache_extra_key=draw(st.sampled_from([0, 0, 0, 7])),
            abort=abort,
            abort_step=arrival_step + draw(st.integers(0, 12)) if abort else None,
        ))
    # The largest request must fit the pool; a little slack beyond it forces preemption.
    lookahead = cfg["num_lookahead_tokens"]
    need = max(
        math.ceil((min(len(r["prompt"]) + r["max_tokens"], max_model_len) - 1 + lookahead) / bs) for r in requests)
    need = max(need, 1) * max(1, len(cfg["kv_group_windows"]))  # a sliding group holds at most as many
    cfg["num_blocks"] = 1 + need + draw(st.sampled_from([0, 0, 1, 2, need, 2 * need + 2]))
    seed = draw(st.integers(0, 2**31 - 1))
    reset_every = draw(st.sampled_from([0, 0, 3, 7]))
    cfg["num_speculative_tokens"] = draw(st.sampled_from([0, 0, 1, 3, 6]))
    return cfg, requests, seed, reset_every


def sampler(seed):
    def sample(handle, index):
        x = (seed * 0x9E3779B1 + handle * 0x85EBCA77 + index * 0xC2B2AE3D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
        return x % SAMPLE_VOCAB
    return sample


def held_blocks(state):
    """Every block a request holds, in all its KV groups (0 in a group's table: the null block)."""
    return state["block_ids"] + [b for table in state["group_block_ids"] for b in table if b]


class Checker:
    def __init__(self, cfg, requests, seed):
        cfg = dict(cfg)
        self.num_speculative = cfg.pop("num_speculative_tokens", 0)
        self.cfg = cfg
        self.windows = cfg.get("kv_group_windows") or [0]
        self.sched = _C.Scheduler(_C.SchedulerConfig(**cfg))
        self.sample = sampler(seed)
        self.seed = seed
        self.drafts = {}  # handle -> the drafts the scheduler keeps for its next step
        self.specs = {}  # handle -> request spec
        self.tokens = {}  # handle -> prompt + outputs
        self.outputs = {}
        self.finish = {}  # handle -> (reason, stop_reason)
        self.aborted = set()
        self.live = set()  # unfinished handles, as the test knows them
        self.arrival = {}
        self.finished_seen = []
        self.dtype = np.int64 if seed % 2 else np.int32
        # A model of the KV cache: slot -> tag of the token sequence whose last token's KV the
        # slot holds. A token's KV depends on its whole prefix (and the request's extra key).
        self.kv = {}
        self.prefix_tags = {}  # handle -> [tag of tokens[:p + 1] for each position p]
        self.verifying = {}  # handle -> the drafts its open step verifies

    # --- invariants -------------------------------------------------------------------------

    def check_pool(self, copy_sources=()):
        """copy_sources: the partial cached blocks the open step copies (it holds them)."""
        sched, pool = self.sched, self.sched.block_pool
        n = pool.num_blocks
        assert pool.num_free_blocks + pool.num_used_blocks == n - 1
        refs = sched.block_ref_counts()
        expected = [0] * n
        for b in copy_sources:
            expected[b] += 1
        for h in self.live:
            state = sched.request_state(h)
            assert state is not None, f"request {h} vanished"
            blocks = held_blocks(state)
            assert len(set(blocks)) == len(blocks), f"request {h} holds a block twice: {blocks}"
            for b in blocks:
                assert 0 < b < n
                expected[b] += 1
        assert refs[1:] == expected[1:], "reference counts differ from the live block tables"
        assert sum(1 for r in refs[1:] if r == 0) == pool.num_free_blocks
        assert pool.num_cached_blocks <= n - 1
        if not self.cfg["enable_prefix_caching"]:
            assert pool.num_cached_blocks == 0
        assert sched.num_running <= self.cfg["max_num_seqs"]
        assert len(self.live) == sched.num_running + sched.num_waiting

    def check_batch(self, out, running_before):
        cfg, sched = self.cfg, self.sched
        bs = cfg["block_size"]
        handles = out.req_handles.tolist()
        nsched = out.num_scheduled_tokens.tolist()
        ncomp = out.num_computed_tokens.tolist()
        R = len(handles)
        T = sum(nsched)
        assert T == len(out.input_ids) == len(out.positions) == len(out.slot_mapping)
        assert T <= cfg["max_num_batched_tokens"]
        assert R <= cfg["max_num_seqs"]
        # Within what an engine on a GPU reserves kernel workspaces for (worker/gpu_memory.py), so
        # that no step allocates one after startup.
        for graphs in (False, True):
            limits = step_limits(cfg["max_num_batched_tokens"], cfg["max_num_seqs"], cfg["max_model_len"], bs, graphs)
            assert T <= limits["max_tokens"] and R <= limits["max_seqs"] <= limits["max_tokens"]
            assert out.block_table.shape[1] <= limits["max_blocks_per_seq"]
        assert len(set(handles)) == R
        qsl = out.query_start_loc.tolist()
        assert qsl == [0] + list(np.cumsum(nsched, dtype=np.int64))
        assert out.seq_lens.tolist() == [c + k for c, k in zip(ncomp, nsched)]
        ndraft = out.num_draft_tokens.tolist()
        assert out.logits_indices.tolist() == [q - 1 - k for q, d in zip(qsl[1:], ndraft) for k in range(d, -1, -1)]
        positions = out.positions.tolist()
        input_ids = out.input_ids.tolist()
        slots = out.slot_mapping.tolist()
        table = out.block_table
        for i, h in enumerate(handles):
            assert h in self.live
            assert nsched[i] >= 1
            lo, hi = qsl[i], qsl[i + 1]
            # Positions contiguous from the request's computed tokens, inside the known tokens
            # and the drafts (verified after the newest token).
            drafts = self.drafts.pop(h, [])
            assert ndraft[i] <= len(drafts)
            if ndraft[i]:
                assert ncomp[i] + nsched[i] - ndraft[i] == len(self.tokens[h])
            seq = self.tokens[h] + drafts[:ndraft[i]]
            self.verifying[h] = drafts[:ndraft[i]]
            assert positions[lo:hi] == list(range(ncomp[i], ncomp[i] + nsched[i]))
            assert ncomp[i] + nsched[i] <= len(seq)
            assert ncomp[i] + nsched[i] <= cfg["max_model_len"] - 1
            assert input_ids[lo:hi] == seq[ncomp[i] : ncomp[i] + nsched[i]]
            threshold = cfg["long_prefill_token_threshold"]
            if threshold and cfg["enable_chunked_prefill"]:
                assert nsched[i] <= threshold
            if not cfg["enable_chunked_prefill"]:
                assert ncomp[i] + nsched[i] >= len(self.tokens[h]), "prompt split without chunked prefill"
            state = sched.request_state(h)
            assert state["status"] == "running"
            assert state["num_computed_tokens"] == ncomp[i] + nsched[i]
            blocks = state["block_ids"]
            assert len(blocks) * bs >= ncomp[i] + nsched[i]
            row = table[i].tolist()
            assert row[: len(blocks)] == blocks
            assert all(b == 0 for b in row[len(blocks):])
            for p, s in zip(positions[lo:hi], slots[lo:hi]):
                assert s == blocks[p // bs] * bs + p % bs
            for g, group_blocks in enumerate(state["group_block_ids"]):
                assert len(group_blocks) == len(blocks)
                assert out.group_block_tables[g, i].tolist()[: len(blocks)] == group_blocks
                for p, s in zip(positions[lo:hi], out.group_slot_mappings[g, lo:hi].tolist()):
                    assert group_blocks[p // bs] != 0 and s == group_blocks[p // bs] * bs + p % bs
        assert out.group_block_tables.shape == (len(self.windows) - 1, R, table.shape[1])
        for h in out.preempted_handles.tolist():
            assert h not in handles
            self.drafts.pop(h, None)  # preemption drops them
            state = sched.request_state(h)
            assert state["status"] == "preempted" and held_blocks(state) == [] and state["num_computed_tokens"] == 0
        # Victims: the requests served last under the policy, in that order.
        preempted = out.preempted_handles.tolist()
        if preempted:
            if cfg["policy"] == "priority":
                key = lambda h: (self.specs[h]["priority"], self.specs[h]["arrival_time"], self.arrival[h])  # noqa: E731
            else:
                key = lambda h: self.arrival[h]  # noqa: E731
            assert set(preempted) <= set(running_before)
            assert preempted == sorted(running_before, key=key, reverse=True)[: len(preempted)]
        # Running requests first, then the newly admitted ones.
        is_new = out.is_new.tolist()
        assert is_new == sorted(is_new)
        self.group_slots = out.group_slot_mappings.tolist()
        self.check_kv(handles, ncomp, nsched, slots, qsl, out.block_copies.reshape(-1, 2).tolist(), is_new)

    def tag(self, h, p):
        """The KV tag of position p of request h's tokens, then of the drafts it verifies."""
        tags = self.prefix_tags[h]
        toks = self.tokens[h]
        while len(tags) <= min(p, len(toks) - 1):
            parent = tags[-1] if tags else self.specs[h]["cache_extra_key"]
            tags.append(hash((parent, toks[len(tags)])))
        if p < len(toks):
            return tags[p]
        return hash((self.tag(h, p - 1), self.verifying[h][p - len(toks)]))

    def check_kv(self, handles, ncomp, nsched, slots, qsl, copies, is_new):
        """This step copies its partial-block cache hits, then writes the KV of its scheduled
        tokens; every token of a scheduled request up to the end of its chunk must then find its
        own prefix's KV in its slot: cache hits hold the right tokens, and no block someone still
        reads was handed out again. (A request may hit a block that another request of the same
        step computes: as in vLLM, each layer writes the step's KV before its attention reads it.)
        Hybrid models: every group writes its slots (one block id is the same bytes in every
        group), and a sliding group's tokens find the keys of their window."""
        bs = self.cfg["block_size"]
        targets = {self.sched.request_state(h)["block_ids"][c // bs]
                   for h, c, new in zip(handles, ncomp, is_new) if new and c % bs}
        assert sorted(dst for _, dst in copies) == sorted(targets), "copies go into the partial hits' own blocks"
        for src, dst in copies:
            for o in range(bs):
                self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        written = set()
        for group_slots in [slots] + self.group_slots:
            for i, h in enumerate(handles):
                for k, p in enumerate(range(ncomp[i], ncomp[i] + nsched[i])):
                    slot = group_slots[qsl[i] + k]
                    assert slot not in written, f"slot {slot} written twice in one step"
                    written.add(slot)
                    self.kv[slot] = self.tag(h, p)
        for i, h in enumerate(handles):
            state = self.sched.request_state(h)
            for w, blocks in zip(self.windows, [state["block_ids"]] + state["group_block_ids"]):
                for p in range(max(0, ncomp[i] - w + 1) if w else 0, ncomp[i] + nsched[i]):
                    slot = blocks[p // bs] * bs + p % bs
                    assert blocks[p // bs] != 0 and self.kv.get(slot) == self.tag(h, p), (
                        f"request {h}: position {p} (slot {slot}, window {w}) does not hold the KV of its prefix"
                        f" (computed {ncomp[i]}, scheduled {nsched[i]})")

    def check_stop_rules(self, h):
        spec = self.specs[h]
        outs = self.outputs[h]
        prompt_len = len(spec["prompt"])

        def stops_at(k):  # would the k-th output (0-based) end the request?
            tok = outs[k]
            if k + 1 < spec["min_tokens"]:
                return False
            eos = not spec["ignore_eos"] and spec["eos_token_id"] >= 0 and tok == spec["eos_token_id"]
            return eos or tok in spec["stop_token_ids"]

        assert not any(stops_at(k) for k in range(len(outs) - 1)), "a stop was missed"
        reason, stop_reason = self.finish[h]
        if reason == FINISH_STOP:
            assert stops_at(len(outs) - 1)
            assert len(outs) >= spec["min_tokens"]
            last = outs[-1]
            if stop_reason == -1:
                assert not spec["ignore_eos"] and last == spec["eos_token_id"]
            else:
                assert stop_reason == last and last in spec["stop_token_ids"]
        else:
            assert reason == FINISH_LENGTH, reason
            assert stop_reason == -1
            assert len(outs) == min(spec["max_tokens"], self.cfg["max_model_len"] - prompt_len)
            if len(outs):
                assert not stops_at(len(outs) - 1)

    # --- driving ----------------------------------------------------------------------------

    def add(self, spec):
        h = self.sched.add_request(
            spec["request_id"], spec["prompt"], max_tokens=spec["max_tokens"], min_tokens=spec["min_tokens"],
            eos_token_id=spec["eos_token_id"], stop_token_ids=spec["stop_token_ids"], ignore_eos=spec["ignore_eos"],
            priority=spec["priority"], arrival_time=spec["arrival_time"], cache_extra_key=spec["cache_extra_key"])
        assert h not in self.specs
        self.specs[h] = spec
        self.arrival[h] = len(self.arrival)
        self.tokens[h] = list(spec["prompt"])
        self.outputs[h] = []
        self.prefix_tags[h] = []
        self.live.add(h)
        spec["handle"] = h

    def abort(self, spec):
        h = spec["handle"]
        self.sched.abort_requests([spec["request_id"]])
        return h

    def step(self, pending_during, arrive_during=()):
        sched = self.sched
        running_before = sched.running_handles()
        out = sched.schedule()
        self.finished_seen += out.finished_handles.tolist()
        self.check_batch(out, running_before)
        self.check_pool(out.block_copies[::2].tolist())
        handles = out.req_handles.tolist()
        ncomp = out.num_computed_tokens.tolist()
        nsched = out.num_scheduled_tokens.tolist()
        ndraft = out.num_draft_tokens.tolist()
        completes = [c + k - d == len(self.tokens[h]) for h, c, k, d in zip(handles, ncomp, nsched, ndraft)]
        for spec in arrive_during:  # added between schedule() and update: waits for the next step
            self.add(spec)
            assert sched.request_state(spec["handle"])["status"] == "waiting"
        abort_now = [s["handle"] for s in pending_during if "handle" in s and s["handle"] in self.live]
        for s in pending_during:
            if "handle" in s:
                self.abort(s)
        # Deferred: the aborted requests are still there until the update.
        for h in abort_now:
            assert sched.request_state(h) is not None
        rows = [self.verify(h) for h in handles]
        sampled = np.array([t for row in rows for t in row], dtype=self.dtype)
        # A step may schedule nothing while requests remain (a running request that preempts
        # itself ends the step). Empty numpy arrays are covered by test_scheduler.py's
        # test_empty_schedule; here an empty step gets an empty torch tensor.
        if not handles:
            up = sched.update_from_output(torch.zeros(0, dtype=torch.int32))
        elif not self.num_speculative:
            up = sched.update_from_output(sampled)
        else:
            up = sched.update_from_output(sampled, np.cumsum([0] + [len(r) for r in rows], dtype=np.int32))
        self.verifying.clear()
        assert up.req_handles.tolist() == handles
        offs = up.new_token_offsets.tolist()
        new_ids = up.new_token_ids.tolist()
        reasons = up.finish_reasons.tolist()
        stops = up.stop_reasons.tolist()
        for i, h in enumerate(handles):
            new = new_ids[offs[i] : offs[i + 1]]
            # The row's tokens, up to one that stops the request.
            assert new == (rows[i][:len(new)] if completes[i] else [])
            self.outputs[h] += new
            self.tokens[h] += new
            if reasons[i] != FINISH_RUNNING:
                assert completes[i]
                self.finish[h] = (reasons[i], stops[i])
                self.live.discard(h)
            else:
                assert stops[i] == -1
                assert len(new) == (len(rows[i]) if completes[i] else 0)
                if completes[i] and h not in abort_now:  # the rejected drafts' KV no longer counts
                    assert sched.request_state(h)["num_computed_tokens"] == len(self.tokens[h]) - 1
        for h in abort_now:
            if h in self.live:
                self.aborted.add(h)
                self.live.discard(h)
            assert sched.request_state(h) is None
        self.check_pool()
        if self.num_speculative:
            self.propose([h for h, done in zip(handles, completes) if done and h in self.live])

    def verify(self, h):
        """The sampler's tokens for h's step: its accepted drafts, then the token after them."""
        drafts = self.verifying.get(h, [])
        row = []
        for d in drafts + [None]:
            row.append(self.sample(h, len(self.outputs[h]) + len(row)))
            if row[-1] != d:
                break
        return row

    def propose(self, handles):
        """Drafts for the decoding requests: the sampler's next tokens with some made wrong, or
        (odd seeds) prompt lookup, which may propose nothing."""
        k = self.num_speculative
        if self.seed % 2:
            offsets, tokens = self.sched.propose_ngram(handles, 1, 3, k)
            proposals = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(handles))]
        else:
            proposals = []
            for h in handles:
                n = len(self.outputs[h])
                proposals.append([self.sample(h, n + j) if (h * 7 + n * 3 + j) % 5 else SAMPLE_VOCAB + 1
                                  for j in range((h + n) % (k + 1))])
        self.sched.set_draft_tokens(handles, np.cumsum([0] + [len(p) for p in proposals]).tolist(),
                                    [t for p in proposals for t in p])
        for h, p in zip(handles, proposals):
            room = self.specs[h]["max_tokens"] - len(self.outputs[h]) - 1
            self.drafts[h] = list(p[:max(0, room)])
            assert self.sched.request_state(h)["spec_token_ids"] == self.drafts[h]


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_keep_the_invariants(workload):
    cfg, requests, seed, reset_every = workload
    c = Checker(cfg, requests, seed)
    sched = c.sched
    total = sum(len(r["prompt"]) + r["max_tokens"] for r in requests)
    step_limit = 50 * total + 100  # generous: a livelock runs into it
    pending = sorted(requests, key=lambda r: r["arrival_step"])
    step = 0
    steps_run = 0
    while pending or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and pending[0]["arrival_step"] > step:
            step = pending[0]["arrival_step"]  # nothing to run until the next arrival
        arrive_during = []
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.pop(0)
            if spec["add_during_step"] and sched.has_unfinished_requests():
                arrive_during.append(spec)
            else:
                c.add(spec)
        for spec in requests:
            if spec["abort"] == "before" and spec["abort_step"] == step and "handle" in spec:
                h = spec["handle"]
                was_live = h in c.live
                c.abort(spec)
                if was_live:
                    c.aborted.add(h)
                    c.live.discard(h)
                assert sched.request_state(h) is None
                c.check_pool()
        if reset_every and step % reset_every == 0:
            used = sched.block_pool.num_used_blocks
            assert sched.reset_prefix_cache() == (used == 0)
            if used == 0:
                assert sched.block_pool.num_cached_blocks == 0
        if not sched.has_unfinished_requests():
            for spec in arrive_during:
                c.add(spec)
            arrive_during = []
        if sched.has_unfinished_requests():
            during = [s for s in requests if s["abort"] == "during" and s["abort_step"] == step]
            c.step(during, arrive_during)
            steps_run += 1
            assert steps_run <= step_limit, "the workload did not finish: livelock?"
        step += 1

    # Everything finished: every request either ran to a stop / length or was aborted.
    assert set(c.specs) == set(c.finish) | c.aborted
    assert not (set(c.finish) & c.aborted)
    for h in c.finish:
        c.check_stop_rules(h)
    for h in c.aborted:
        assert c.specs[h]["abort"] is not None
        assert len(c.outputs[h]) <= c.specs[h]["max_tokens"]
    # Every finished or aborted request is reported once in finished_handles.
    out = sched.schedule()
    c.finished_seen += out.finished_handles.tolist()
    assert out.num_reqs == 0
    assert not sched.has_unfinished_requests()
    assert sorted(c.finished_seen) == sorted(c.specs)
    pool = sched.block_pool
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks - 1
    refs = sched.block_ref_counts()
    assert all(r == 0 for r in refs[1:])
    assert pool.num_cached_blocks <= pool.num_blocks - 1
    assert sched.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 8),  # requests sharing one prompt
    st.sampled_from([1, 4, 16]),  # block size
    st.integers(1, 80),  # prompt length
    st.integers(0, 2**31 - 1),
)
def test_identical_prompts_share_cached_blocks(n, bs, prompt_len, seed):
    sched = _C.Scheduler(_C.SchedulerConfig(num_blocks=512, block_size=bs, max_model_len=128,
                                            max_num_batched_tokens=128))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 50, size=prompt_len).tolist()
    first = sched.add_request("first", prompt, max_tokens=2)
    out = sched.schedule()
    assert out.num_computed_tokens.tolist() == [0]
    sched.update_from_output(np.array([1], dtype=np.int32))
    expected_hit = ((prompt_len - 1) // bs) * bs
    handles = [sched.add_request(f"r{i}", prompt, max_tokens=2) for i in range(n)]
    hits0 = sched.prefix_cache_stats["hits"]
    out = sched.schedule()
    assert out.req_handles.tolist() == [first] + handles
    assert out.num_computed_tokens.tolist() == [prompt_len] + [expected_hit] * n
    assert sched.prefix_cache_stats["hits"] - hits0 == expected_hit * n
    shared = expected_hit // bs
    first_blocks = sched.request_state(first)["block_ids"][:shared]
    refs = sched.block_ref_counts()
    for h in handles:
        assert sched.request_state(h)["block_ids"][:shared] == first_blocks
    for b in first_blocks:
        assert refs[b] == n + 1
    sched.update_from_output(np.ones(n + 1, dtype=np.int32))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(np.ones(out.num_reqs, dtype=np.int32))
    assert sched.block_pool.num_used_blocks == 0
