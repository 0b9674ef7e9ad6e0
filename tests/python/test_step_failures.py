"""A failure inside an engine step ends only the requests it concerns: a forward pass that
raises aborts the requests of that step, a sampler, detokenizer or stop-check failure aborts
the request alone, and everyone else finishes with the outputs they get on a quiet server.

The server runs in this process (uvicorn in a thread) so that the tests can make chosen parts
of the engine fail for marked ("poisoned") requests while real HTTP clients load it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

for _module in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import uvicorn  # noqa: E402

import octavo.engine.output_processor as output_processor_module  # noqa: E402
import octavo.worker.worker as worker_module  # noqa: E402
from live_server import free_port  # noqa: E402
from octavo import LLM, SamplingParams  # noqa: E402
from octavo.engine.async_llm import AsyncLLM  # noqa: E402
from octavo.entrypoints.openai.api_server import build_app  # noqa: E402
from octavo.entrypoints.openai.serving import ServedModel  # noqa: E402
from octavo.loader import load_tokenizer  # noqa: E402

SAMPLER_POISON_SEED = 666  # sampling this request raises
STEP_POISON_SEED = 777  # step() raises outside the engine's per-request handling
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


# Each failure once without and once with speculative decoding (whose steps verify drafts).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module", params=[None, SPECULATIVE], ids=["plain", "speculative"])
def llm(request):
    return LLM(max_model_len=256, device="cpu", max_num_seqs=64, speculative_config=request.param)


class InProcessServer:
    def __init__(self, llm: LLM):
        engine = llm.llm_engine
        self.engine = engine
        self.served = ServedModel(engine=AsyncLLM(engine), tokenizer=load_tokenizer(engine.model_path),
                                  names=["smol"], root=str(engine.model_path), max_model_len=engine.max_model_len)
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn.Config(build_app(self.served), host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def wait_idle(self) -> int:
        """Used KV blocks once the engine has no request left."""
        deadline = time.monotonic() + 30
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
        return self.engine.scheduler.block_pool.num_used_blocks

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(llm):
    s = InProcessServer(llm)
    yield s
    s.stop()


@pytest.fixture
def poisoned(server, monkeypatch):
    """Makes each part of a step fail for the requests marked for it."""
    engine = server.engine
    core = engine.core.engine_core  # the in-process core and executor: failures are injected there
    worker = core.executor.driver_worker

    def request_of(handle):  # the front end's request of a scheduler handle
        return engine._by_core_id[core._live[handle].request_id][0]

    processor = engine.output_processor
    execute, detokenizer, sample_, check_stop = (worker.runner.execute, processor.detokenizer, worker_module.sample,
                                                 output_processor_module.check_stop_strings)

    def failing_execute(out, rows):
        if any("POISON-FORWARD" in (request_of(h).prompt or "") for h in out.req_handles.tolist()):
            raise RuntimeError("injected forward failure [kernel.cc:1]")
        return execute(out, rows)

    def failing_sample(logits, states, staging=None, drafts=None):
        if any(s.params.seed == SAMPLER_POISON_SEED for s in states):
            raise RuntimeError("injected sampler failure")
        return sample_(logits, states, staging, drafts)

    class FailingDetokenizer:
        def __init__(self, inner):
            self.inner = inner

        def add_tokens(self, tokens):
            raise RuntimeError("injected detokenizer failure")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def failing_detokenizer(request):
        inner = detokenizer(request)
        return FailingDetokenizer(inner) if "POISON-DETOK" in (request.prompt or "") else inner

    def failing_check_stop(text, new_chars, stop, include):
        if "POISON-STOP" in stop:
            raise RuntimeError("injected stop-check failure")
        return check_stop(text, new_chars, stop, include)

    new_requests = core._new_requests

    def failing_new_requests(out):
        if any(request_of(h).params.seed == STEP_POISON_SEED for h in out.req_handles.tolist()):
            raise RuntimeError("injected failure outside the per-request handling")
        return new_requests(out)

    monkeypatch.setattr(worker.runner, "execute", failing_execute)
    monkeypatch.setattr(worker_module, "sample", failing_sample)
    monkeypatch.setattr(processor, "detokenizer", failing_detokenizer)
    monkeypatch.setattr(output_processor_module, "check_stop_strings", failing_check_stop)
    monkeypatch.setattr(core, "_new_requests", failing_new_requests)


POISONS = {
    "forward": {"prompt": "POISON-FORWARD story"},
    "sampler": {"prompt": "A story", "seed": SAMPLER_POISON_SEED, "temperature": 1.0},
    "detokenizer": {"prompt": "POISON-DETOK story"},
    "stop check": {"prompt": "A story", "stop": ["POISON-STOP"]},
    "step": {"prompt": "A story", "seed": STEP_POISON_SEED, "temperature": 1.0},
}


async def _complete(client: httpx.AsyncClient, body: dict, stream: bool) -> tuple[int, str]:
    """(status, text); a stream that ends in an error event gives (500, its message)."""
    if not stream:
        r = await client.post("/v1/completions", json=body)
        data = r.json()
        return r.status_code, data["choices"][0]["text"] if r.status_code == 200 else data["error"]["message"]
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    events = [httpx.Response(200, content=line[6:]).json() for line in lines[:-1]]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        return errors[0]["code"], errors[0]["message"]
    return 200, "".join(e["choices"][0]["text"] for e in events)


def _load(server, poison: dict, stream: bool) -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[str]]:
    """24 ordinary requests with 3 poisoned ones among them: (ordinary results, poisoned results,
    the ordinary requests' outputs on a quiet server)."""
    prompts = [f"Item {i} of the list is" for i in range(24)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            quiet = [(await _complete(client, {"prompt": p, **GREEDY}, False))[1] for p in prompts[:4]]
            ordinary = [_complete(client, {"prompt": p, **GREEDY}, stream) for p in prompts]
            bad = [_complete(client, {**GREEDY, **poison, "max_tokens": 12 + k}, stream) for k in range(3)]
            results = await asyncio.gather(*ordinary[:12], *bad, *ordinary[12:])
            return results[:12] + results[15:], results[12:15], quiet

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("part", list(POISONS))
def test_a_failure_aborts_only_its_requests(server, poisoned, part, stream):
    ordinary, bad, quiet = _load(server, POISONS[part], stream)
    for status, message in bad:
        assert status == 500, message
        assert "aborted this request" in message and ".cc:" not in message and "injected" not in message
    if part in ("forward", "step"):  # requests that shared a step with a poisoned one fail with it
        assert all(status in (200, 500) for status, _ in ordinary)
    else:
        assert all(status == 200 for status, _ in ordinary), ordinary
    # The first four ordinary requests ran alone before the load: whoever finished matches them.
    for (status, text), expected in zip(ordinary, quiet):
        assert status != 200 or text == expected
    assert server.wait_idle() == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
    # And the engine is whole: a request after the failures gets its quiet-server answer.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Item 0 of the list is", **GREEDY}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == quiet[0]


def test_offline_generate_reports_the_failed_request(monkeypatch):
    """Offline, a request whose detokenizer fails ends with finish_reason "error" and the others
    get the outputs they get alone. (An engine of its own: the server's engine thread steps its
    engine whenever that holds requests.)"""
    llm = LLM(max_model_len=256, device="cpu")
    engine = llm.llm_engine
    detokenizer = engine.output_processor.detokenizer

    def failing_detokenizer(request):
        inner = detokenizer(request)
        if "POISON-DETOK" in (request.prompt or ""):
            inner.add_tokens = lambda tokens: (_ for _ in ()).throw(RuntimeError("injected"))
        return inner

    monkeypatch.setattr(engine.output_processor, "detokenizer", failing_detokenizer)
    prompts = ["Item 1 of the list is", "POISON-DETOK story", "Item 2 of the list is"]
    outputs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    alone = llm.generate(prompts[::2], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].text for o in outputs[::2]] == [o.outputs[0].text for o in alone]
    assert not engine.has_unfinished_requests() and engine.scheduler.block_pool.num_used_blocks == 0
