"""``AsyncLLM``: the engine for a server. Requests arrive on an asyncio event loop; each
request's outputs stream back as deltas.

Threads: the engine thread alone touches the ``LLMEngine`` (it is not thread-safe). The event
loop hands it requests and aborts through a command queue and receives outputs through
``loop.call_soon_threadsafe``, so a coroutine never waits for a model step. With the engine core
in its own process (the server's default), the engine thread sends it requests, waits for its
step outputs, and detokenizes them, while the core steps; in-process, the engine thread steps
the core itself (the forward pass releases the GIL, so the event loop keeps running meanwhile).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .core_messages import EngineDeadError
from .llm_engine import LLMEngine
from .stats import EngineStats

logger = logging.getLogger("octavo.engine")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request and aborted it (details in the server log)."""


# Steps that raise in a row before /health reports the engine unhealthy: one bad step is a
# request's problem (its requests are aborted), several in a row are the engine's.
MAX_FAILED_STEPS_IN_A_ROW = 3
IDLE_POLL_SECONDS = 1.0  # an idle engine thread looks for stray core messages (stats) this often


@dataclass
class _Stream:
    """One request as the event loop sees it: a queue of delta outputs."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item) -> None:  # called from the engine thread
        _send_to_loop(self.loop, [(self.queue, item)])


def _send_to_loop(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    """Puts each item in its queue, from the engine thread: one wake-up of the event loop for
    all of them (a step's outputs for every stream)."""
    def put_all():
        for queue, item in items:
            queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass


class AsyncLLM:
    """Wraps an ``LLMEngine`` whose steps run in a background thread.

    ``generate()`` is an async generator of delta ``RequestOutput``s: each carries only the text,
    token ids and logprobs that are new since the previous one; the last has ``finished=True``.
    Leaving the generator early (client disconnect, timeout, cancellation) aborts the request
    and its KV blocks go back to the pool.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None, model_name: str = "octavo"):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats = EngineStats(engine, model_name)
        self._commands: collections.deque = collections.deque()  # appended by the loop, drained by the thread
        # Written by the event loop when a command arrives; the engine thread sleeps on it (and,
        # with the engine core in another process, on the core's outputs at the same time).
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._streams: dict[str, _Stream] = {}  # written by the loop, read by the thread (dict ops are atomic)
        self._live: set[str] = set()  # requests in the engine; engine thread only
        # Requests submitted (counted by the event loop) and taken in (by the engine thread): one
        # writer each, so the difference (not yet seen by the engine) needs no lock.
        self._num_submitted = 0
        self._num_taken = 0
        # (waiting, running, requests taken in) as the last step left them, set as one tuple.
        self._after_step = (0, 0, 0)
        self._stopping = False
        self._failed_steps_in_a_row = 0  # written by the engine thread only
        self._dead: str | None = None  # why the engine core stopped, if it did
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side ------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    @property
    def is_healthy(self) -> bool:
        """Running, and its steps are not failing one after another."""
        return self.is_running and self._failed_steps_in_a_row < MAX_FAILED_STEPS_IN_A_ROW

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raises ValueError for a request the engine would refuse, before any response starts."""
        return self.engine.check_request(prompt_token_ids, params)

    def num_waiting(self) -> int:
        """Requests that cannot start at the next step: the scheduler's waiting queue after the
        last step, plus those handed to the engine thread since then beyond the free running
        slots (a request that arrives mid-step and will start at the next one is not waiting)."""
        waiting, running, taken = self._after_step
        pending = self._num_submitted - taken
        free = 0 if waiting else max(0, self.engine.info.max_num_seqs - running)
        return waiting + max(0, pending - free)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"the server has {self.num_waiting()} requests waiting "
                                        f"(limit {self.max_waiting_requests})")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._num_submitted += 1
        params = params.clone()  # the engine itself makes the deltas (stop-string hold-back included)
        params.output_kind = RequestOutputKind.DELTA
        self._submit(("add", request_id, list(prompt_token_ids), params, prompt, priority, time.time()))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is still running, stops the engine thread and the engine core."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout)
        self.engine.shutdown()
        if not self._thread.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"!")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        remote = engine.core_is_remote
        if remote:  # a core step's outputs or a command, whichever comes first, ends the wait
            engine.core.set_wakeup_fd(self._wake_read)
        while not self._stopping:
            self._drain_commands()
            idle = not engine.has_unfinished_requests()
            if idle and not remote:
                select.select([self._wake_read], [], [], IDLE_POLL_SECONDS)
                continue
            try:
                outputs = engine.step(timeout=IDLE_POLL_SECONDS if idle else None)
                self.stats.snapshot()
                self._after_step = (self.stats.num_waiting, self.stats.num_running, self._num_taken)
            except EngineDeadError as e:
                logger.error("the engine core died: %s", e)
                self._dead = str(e)
                break
            except Exception:  # noqa: BLE001 - the engine's own per-request handling missed it
                logger.exception("engine step failed; aborting its requests")
                self._failed_steps_in_a_row += 1
                failed = engine.end_failed_step()
                self._deliver(failed)
                if not failed:  # not attributable to a step's requests: none of them can be trusted
                    self._fail_all(RequestFailedError("an engine step failed"))
                continue
            self._failed_steps_in_a_row = 0
            self._deliver(outputs)
        self._fail_all(EngineDeadError(self._dead or "the server is shutting down"), include_pending=True)

    def _drain_commands(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                self._num_taken += 1
                self._add(*command[1:])
            else:
                self._abort(command[1])

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt, priority: int,
             arrival: float) -> None:
        stream = self._streams.get(request_id)
        if stream is None:  # the client left before the engine saw the request
            return
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt, priority=priority)
        except (ValueError, EngineDeadError) as e:
            stream.put(e)
            return
        except Exception:  # noqa: BLE001 - a check the front end missed: this request fails alone
            logger.exception("could not add request %s", request_id)
            stream.put(RequestFailedError("the engine could not take it"))
            return
        self._live.add(request_id)
        self.stats.record_arrival(request_id, len(prompt_token_ids), arrival)

    def _abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.remove(request_id)
            self.engine.abort_request([request_id])
            self.stats.record_abort(request_id)

    def _fail_all(self, error: Exception, include_pending: bool = False) -> None:
        """Aborts every request the engine holds and sends ``error`` to their streams; with
        ``include_pending`` also to the streams of requests still in the command queue."""
        failed = list(self._live)
        for request_id in failed:
            self._abort(request_id)
        for request_id in list(self._streams) if include_pending else failed:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            if output.request_id not in self._live:
                continue
            if output.finished:
                self._live.discard(output.request_id)
            self.stats.record_output(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished and any(o.finish_reason == "error" for o in output.outputs):
                output = RequestFailedError("the engine failed while running it")
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            _send_to_loop(loop, items)
