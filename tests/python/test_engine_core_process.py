"""The engine core in a process of its own: the same outputs as in-process, the wire format's
arrays, and failures: a core that dies mid-run fails what is in flight with a clear error, the
server reports itself unhealthy and answers 503 instead of hanging, and no process outlives the
server."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.engine.core_messages import EngineCoreOutputs, EngineDeadError, SchedulerStats  # noqa: E402
from octavo.engine.serial import INLINE_BYTES, Decoder, Encoder  # noqa: E402
from octavo.executor.step_io import SamplerOutput  # noqa: E402


def make_llm(path, multiprocess: bool) -> LLM:
    return LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
               multiprocess=multiprocess)


@pytest.fixture(scope="module")
def pair(tiny_path):
    remote, local = make_llm(tiny_path, True), make_llm(tiny_path, False)
    yield remote, local
    remote.llm_engine.shutdown()


def test_a_core_process_gives_the_in_process_outputs(pair):
    """Greedy and seeded tokens, logprobs, prompt logprobs, n > 1, stop strings and prefix-cache
    hits come back the same across the process boundary."""
    remote, local = pair
    assert remote.llm_engine.core_is_remote and not local.llm_engine.core_is_remote
    # Once connected the sockets' directory is gone: a SIGKILLed front end leaves nothing in /tmp.
    assert not os.path.exists(remote.llm_engine.core._dir)
    prompts = ["Hello world", "Emoji time 😀", "x", "Hello world, once more. " * 4, "Stop me"]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, stop=["o"], ignore_eos=True),
              # Samples ended by a stop string while their siblings run on: what a remote core
              # stepped before the abort arrived is not theirs.
              SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=24, stop=["e", "a"], ignore_eos=True)]

    def view(outputs):  # logprobs rounded: a step's batch may differ by a request the other side stopped sooner
        return [(rounded(o.prompt_logprobs), o.num_cached_tokens,
                 [(c.token_ids, c.text, rounded(c.logprobs), c.finish_reason, c.stop_reason) for c in o.outputs])
                for o in outputs]

    for _ in range(2):  # the second round hits the prefix cache
        assert view(remote.generate(prompts, params, use_tqdm=False)) == \
            view(local.generate(prompts, params, use_tqdm=False))
    assert remote.llm_engine.stats.num_used_blocks == 0
    assert remote.llm_engine.stats.prefix_cache_hits == local.llm_engine.stats.prefix_cache_hits > 0


def rounded(entries):
    if entries is None:
        return None
    return [None if e is None else {t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in entries]


def test_calls_reach_the_workers_in_the_core_process(pair):
    remote, local = pair
    assert remote.apply_model(lambda m: type(m).__name__) == local.apply_model(lambda m: type(m).__name__)
    assert remote.collective_rpc(lambda worker: os.getpid()) != [os.getpid()]
    assert remote.llm_engine.reset_prefix_cache()
    with pytest.raises(ZeroDivisionError):  # a call that raises raises here, and the core lives on
        remote.collective_rpc(lambda worker: 1 / 0)
    out = remote.generate("x", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(AttributeError, match="another process"):
        remote.llm_engine.scheduler


def test_a_refused_engine_fails_at_startup_with_its_own_error(tiny_path):
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=1000, multiprocess=True)


def test_a_request_too_large_for_the_cache_is_refused_before_the_core(tiny_path, pair):
    """The scheduler's own check, made by the front end: a core in another process never has
    to refuse a request."""
    block = pair[1].llm_engine.info.kv_block_bytes
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=3 * block, max_model_len=128)
    with pytest.raises(ValueError, match="needs up to 8 KV blocks .* has 2"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=60), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate([[1] * 20], SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_a_killed_core_fails_generate_with_a_clear_error(tiny_path):
    llm = make_llm(tiny_path, True)
    killer = threading.Timer(0.5, os.kill, (llm.llm_engine.core.process.pid, signal.SIGKILL))
    killer.start()
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDeadError, match="died"):
        while time.monotonic() < deadline:
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", use_tqdm=False)
    llm.llm_engine.shutdown()


def test_the_core_process_ends_with_its_engine(tiny_path):
    llm = make_llm(tiny_path, True)
    process = llm.llm_engine.core.process
    llm.llm_engine.shutdown()
    assert process.poll() is not None


# ---- the wire format ------------------------------------------------------------------------

DTYPES = [np.int8, np.int32, np.int64, np.float32, np.uint8]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 70), min_size=0, max_size=3), st.integers(0, 2))
def test_arrays_cross_unchanged_inline_or_as_frames(dtype, shape, rows):
    rng = np.random.default_rng(len(shape))
    array = np.asarray((rng.standard_normal(shape) * 100).astype(dtype))
    token_ids = np.arange(rows, dtype=np.int32)
    outputs = EngineCoreOutputs([f"r{i}" for i in range(rows)], np.arange(rows + 1, dtype=np.int32), token_ids,
                                np.zeros(rows, np.int8), np.full(rows, -1, np.int32), np.full(rows, -1, np.int32),
                                SamplerOutput(token_ids, top_logprobs=array), stats=SchedulerStats(num_waiting=rows))
    frames = Encoder().encode(outputs)
    assert len(frames) == 1 + (array.nbytes >= INLINE_BYTES)  # the rest are below INLINE_BYTES
    back = Decoder(EngineCoreOutputs).decode([bytes(f) for f in frames])
    assert back.request_ids == outputs.request_ids and back.stats == outputs.stats
    got = back.sampled.top_logprobs
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    assert back.sampled.logprobs is None and np.array_equal(back.new_token_offsets, outputs.new_token_offsets)


def test_a_malformed_message_is_refused():
    import msgspec

    frames = Encoder().encode(["not", "outputs"])
    with pytest.raises(msgspec.ValidationError):
        Decoder(EngineCoreOutputs).decode(frames)


# ---- the server ------------------------------------------------------------------------------

def core_processes_of(server_pid: int) -> list[int]:
    """The engine core processes that ``server_pid`` started."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"octavo.engine.core_proc" in command:
            found.append(int(entry))
    return found


def gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie: dead, not yet reaped
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_dead_core_fails_in_flight_requests_and_the_server_says_so(tmp_path):
    """Kill the engine core mid-stream: the stream ends with an OpenAI error event, later
    requests get 503 with an OpenAI error body at once, /health turns 503, and the server still
    shuts down cleanly."""
    import httpx

    from live_server import LiveServer

    server = LiveServer("--max-model-len", "256", log=tmp_path / "serve.log")
    [core] = core_processes_of(server.process.pid)
    lines: list[str] = []

    def stream():
        body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while len(lines) < 3:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    os.kill(core, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive() and lines[-1] == "data: [DONE]"
    error = httpx.Response(200, content=lines[-2][6:]).json()["error"]
    assert error["code"] == 503 and "engine core process died" in error["message"]
    started = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503 and time.monotonic() - started < 5
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_engine_core_outlives_its_server(tmp_path, sig):
    from live_server import LiveServer

    server = LiveServer("--max-model-len", "256", log=tmp_path / "serve.log")
    [core] = core_processes_of(server.process.pid)
    server.stop(sig)
    assert gone(core)


def test_a_request_the_core_refuses_fails_alone(pair):
    """The core takes a message of several requests; one it refuses (a checked front end never
    sends such) ends with "error" on its own, the others run."""
    from octavo.engine.core_messages import EngineCoreRequest
    from octavo.engine.core_proc import _add

    class Outbox:
        def __init__(self):
            self.sent = []

        def send_multipart(self, frames, copy=True):
            self.sent.append(frames)

    core = pair[1].llm_engine.core.engine_core
    ok = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4)
    bad.max_tokens = 0  # past SamplingParams' own check: the scheduler refuses it
    requests = [EngineCoreRequest("a#0", [1, 2, 3], ok, 0, -1, []), EngineCoreRequest("b#0", [1, 2], ok, 0, -1, []),
                EngineCoreRequest("b#1", [1, 2], bad, 0, -1, []), EngineCoreRequest("c#0", [4, 5], ok, 0, -1, [])]
    outbox, encoder = Outbox(), Encoder()
    _add(core, requests, outbox, encoder)
    [frames] = outbox.sent
    refused = Decoder(EngineCoreOutputs).decode([bytes(f) for f in frames[1:]])
    assert refused.request_ids == ["b#0", "b#1"] and list(refused.finish_reasons) == [4, 4]
    assert core.scheduler.handle_of("b#0") is None and core.scheduler.handle_of("b#1") is None
    core.abort_requests(["a#0", "c#0"])
    assert not core.has_unfinished_requests()


def test_text_that_cannot_cross_to_the_core_is_refused_before_it(pair):
    """A lone surrogate cannot be UTF-8, so a stop string or request id holding one could not
    reach a core in another process: the request is refused with a ValueError up front, and the
    requests beside it run."""
    remote, _ = pair
    engine = remote.llm_engine
    engine.add_request("fine", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="a stop string must be a string of valid Unicode"):
        engine.add_request("stop", [5, 6], SamplingParams(stop=["a\ud800"], max_tokens=3))
    with pytest.raises(ValueError, match="request_id must be a string of valid Unicode"):
        engine.add_request("id\udfff", [5, 6], SamplingParams(max_tokens=3))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in done] == [("fine", 3)]
