"""The engine core in a process of its own, and the front end's client of it.

The core process runs the busy loop: take what arrived (requests, aborts, calls), step while
any request is unfinished, send each step's outputs. Two ZeroMQ PUSH/PULL sockets over IPC
carry msgpack frames (serial.py); the rare utility calls (collective_rpc, reset_prefix_cache)
and the startup handshake are pickled. The core dies with the front end (PR_SET_PDEATHSIG), so
a killed server leaves no process behind; a dead core is noticed by the client within
POLL_SECONDS and fails what is in flight.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque

import cloudpickle
import zmq

from ..processes import die_with_parent, keep_to_given_cpus, pickle_error, start_python
from .core import EngineCore, EngineCoreConfig
from .core_messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError, SchedulerStats
from .serial import Decoder, Encoder

logger = logging.getLogger("octavo.engine")

# Message kinds (the first frame).
ADD, ABORT, CALL, SHUTDOWN = b"A", b"X", b"C", b"S"  # to the core
OUTPUTS, RESULT, READY, FAILED = b"O", b"R", b"Y", b"F"  # from the core
POLL_SECONDS = 0.5  # how often a waiting client checks that the core is alive
STARTUP_SECONDS = 900  # loading a model from a slow disk


# ---- the core process ---------------------------------------------------------------------

def run_engine_core(config: EngineCoreConfig, input_address: str, output_address: str) -> None:
    """The core process's body (``python -m octavo.engine.core_proc DIRECTORY``)."""
    die_with_parent()
    keep_to_given_cpus()  # a data-parallel core's share of the CPUs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - the front end re-raises it (a ValueError stays one)
        outbox.send_multipart([FAILED, pickle_error(e)])
        return
    outbox.send_multipart([READY, pickle.dumps(core.info)])
    try:
        _busy_loop(core, inbox, outbox)
    finally:
        core.shutdown()
        outbox.close(linger=1000)
        inbox.close(linger=0)


def _busy_loop(core: EngineCore, inbox, outbox) -> None:
    encoder = Encoder()
    requests, ids = Decoder(list[EngineCoreRequest]), Decoder(list[str])
    while True:
        # Idle: block until something arrives. Busy: only take what is already there.
        timeout = 0 if core.has_unfinished_requests() else None
        aborted = False
        while inbox.poll(timeout):
            frames = inbox.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == SHUTDOWN:
                return
            if kind == ADD:
                _add(core, requests.decode(frames[1:]), outbox, encoder)
            elif kind == ABORT:
                core.abort_requests(ids.decode(frames[1:]))
                aborted = True
            elif kind == CALL:
                outbox.send_multipart([RESULT, _call(core, frames[1].bytes)])
            timeout = 0
        if aborted and not core.has_unfinished_requests():  # no step will report the freed blocks
            outbox.send_multipart([OUTPUTS, *encoder.encode(EngineCoreOutputs.empty(core.stats()))])
        if core.has_unfinished_requests():
            try:
                outputs = core.step()
            except EngineDeadError as e:  # the workers are gone: the front end learns why, then we end
                logger.error("the engine core stops: %s", e)
                outbox.send_multipart([FAILED, pickle_error(e)])
                return
            except Exception:  # noqa: BLE001 - outside the step's own per-request handling
                logger.exception("engine step failed; aborting its requests")
                outputs = core.end_failed_step()
            outbox.send_multipart([OUTPUTS, *encoder.encode(outputs)], copy=False)


def _add(core: EngineCore, requests: list[EngineCoreRequest], outbox, encoder: Encoder) -> None:
    """Adds the requests of one message (several front-end requests, each as its samples
    "<id>#<i>"): all of a request's samples or none. A refusal the front end's checks missed
    comes back as an "error" output for each of that request's samples; the others run."""
    refused = []
    for samples in _by_request(requests):
        try:
            core.add_samples(samples)
        except Exception:  # noqa: BLE001 - this request's problem alone
            logger.exception("the engine core refused request %s", samples[0].request_id)
            refused += [r.request_id for r in samples]
    if refused:
        outbox.send_multipart([OUTPUTS, *encoder.encode(core.error_outputs(refused))], copy=False)


def _by_request(requests: list[EngineCoreRequest]) -> list[list[EngineCoreRequest]]:
    """Consecutive samples of one front-end request ("<id>#<i>"), grouped."""
    groups: dict[str, list[EngineCoreRequest]] = {}
    for r in requests:
        groups.setdefault(r.request_id.rpartition("#")[0], []).append(r)
    return list(groups.values())


def _call(core: EngineCore, payload: bytes) -> bytes:
    call_id, method, args, kwargs = cloudpickle.loads(payload)
    try:
        return cloudpickle.dumps((call_id, True, getattr(core, method)(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - raised again in the caller
        return cloudpickle.dumps((call_id, False, pickle_error(e)))


# ---- the client ---------------------------------------------------------------------------

class MPClient:
    """Starts the core process and talks to it. Not thread-safe: one thread uses it (the
    engine thread of AsyncLLM, or LLM's caller)."""

    def __init__(self, config: EngineCoreConfig, wait: bool = True, env: dict[str, str] | None = None):
        """wait=False: return once the process is started; wait_ready() then waits for it
        (several cores start side by side). env: variables set in the core process (its devices)."""
        self._dir = tempfile.mkdtemp(prefix="octavo-core-")
        self._ctx = zmq.Context()
        self._outbox, self._inbox = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._outbox.bind(input_address)
        self._inbox.bind(output_address)
        with open(f"{self._dir}/config.pkl", "wb") as f:
            pickle.dump(config, f)
        # A new interpreter rather than multiprocessing: a fork of a process running torch's
        # threads may deadlock, and spawn would run the caller's unguarded __main__ again.
        self.process = start_python("octavo.engine.core_proc", self._dir, env=env)
        self._encoder = Encoder()
        self._outputs = Decoder(EngineCoreOutputs)
        self._unsent: list[EngineCoreRequest] = []  # added since the last message to the core
        self._pending: deque[EngineCoreOutputs] = deque()  # outputs that arrived while waiting for a call's result
        self._calls = itertools.count()
        self._last_stats = SchedulerStats()
        self._dead: str | None = None
        # Runs at shutdown(), when the client is collected, or at the interpreter's exit.
        self._finalizer = weakref.finalize(self, _stop, self.process, self._outbox, self._inbox, self._ctx, self._dir)
        if wait:
            self.wait_ready()
        self._waiter = OutputWaiter([self])

    def wait_ready(self) -> None:
        """Waits until the core has loaded the model and sized its cache (its EngineCoreInfo);
        raises the core's own error if it could not start."""
        try:
            self.info = self._handshake()
        except BaseException:
            self.shutdown()
            raise
        # Connected: the sockets need their paths no more, and a front end killed with SIGKILL
        # (which runs no cleanup) leaves nothing behind in /tmp.
        shutil.rmtree(self._dir, ignore_errors=True)

    def _handshake(self):
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._inbox.poll(POLL_SECONDS * 1000):
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not start within {STARTUP_SECONDS} s")
        kind, payload = self._inbox.recv_multipart()
        if kind == FAILED:
            raise pickle.loads(payload)
        return pickle.loads(payload)

    @property
    def scheduler(self):
        raise AttributeError("the engine core runs in another process: its scheduler is not reachable from here; "
                             "read LLMEngine.stats instead")

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Sent with the next message to the core: the requests added between two steps (a
        whole generate() call) reach the core together and start in the same step."""
        self._check_alive()
        self._unsent.extend(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None:  # a dead core holds nothing to abort
            self._send(ABORT, request_ids)

    def _flush(self) -> None:
        if self._unsent:
            requests, self._unsent = self._unsent, []
            self._outbox.send_multipart([ADD, *self._encoder.encode(requests)])

    def set_wakeup_fd(self, fd: int) -> None:
        self._waiter.set_wakeup_fd(fd)

    def step(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The core's next step outputs; empty outputs when ``timeout`` seconds pass first, or
        the wake-up fd fires. Raises EngineDeadError when the core has died."""
        return self._waiter.next(timeout) or EngineCoreOutputs.empty(self._last_stats)

    def receive(self) -> EngineCoreOutputs | None:
        """The message waiting on the output socket: a step's outputs, or None (a late result
        of an abandoned call). Raises EngineDeadError for the core's last words."""
        frames = self._inbox.recv_multipart(copy=False)
        if frames[0].bytes != OUTPUTS:
            self._check_failed(frames)
            return None
        outputs = self._outputs.decode(frames[1:])
        self._last_stats = outputs.stats
        return outputs

    def end_failed_step(self) -> EngineCoreOutputs:
        """The core process ends its own failed steps: nothing to do here."""
        return EngineCoreOutputs.empty(self._last_stats)

    def stats(self) -> SchedulerStats:
        return self._last_stats

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._call("collective_rpc", method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def _call(self, method: str, *args, **kwargs):
        """Runs core.<method>(*args, **kwargs) in the core process (between its steps)."""
        call_id = next(self._calls)
        self._check_alive()
        self._flush()
        self._outbox.send_multipart([CALL, cloudpickle.dumps((call_id, method, args, kwargs))])
        while True:
            if not self._inbox.poll(POLL_SECONDS * 1000):
                self._check_alive()
                continue
            frames = self._inbox.recv_multipart(copy=False)
            if frames[0].bytes == OUTPUTS:
                self._pending.append(self._outputs.decode(frames[1:]))
                continue
            self._check_failed(frames)
            got_id, ok, value = cloudpickle.loads(frames[1].bytes)
            if got_id == call_id:
                if not ok:
                    raise pickle.loads(value)
                return value

    def _send(self, kind: bytes, obj) -> None:
        self._check_alive()
        self._flush()
        self._outbox.send_multipart([kind, *self._encoder.encode(obj)])

    def _check_failed(self, frames) -> None:
        """A FAILED message: the core stopped, saying why."""
        if frames[0].bytes == FAILED:
            self._dead = f"the engine core stopped: {pickle.loads(frames[1].bytes)}"
            raise EngineDeadError(self._dead)

    def _check_alive(self) -> None:
        if self._dead is None and self.process.poll() is not None:
            self._dead = f"the engine core process died (exit code {self.process.returncode})"
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        self._dead = self._dead or "the engine core was shut down"
        self._finalizer()


class OutputWaiter:
    """Waits for the next step outputs of one or more core clients (data parallel), and on an
    optional wake-up fd that ends the wait early (AsyncLLM's: a request arrived)."""

    def __init__(self, clients: list[MPClient]):
        self.clients = clients
        self._poller = zmq.Poller()
        for client in clients:
            self._poller.register(client._inbox, zmq.POLLIN)
        self._wakeup_fd: int | None = None

    def set_wakeup_fd(self, fd: int) -> None:
        """next() also returns when ``fd`` becomes readable; the caller drains it."""
        self._wakeup_fd = fd
        self._poller.register(fd, zmq.POLLIN)

    def next(self, timeout: float | None) -> EngineCoreOutputs | None:
        """Sends what the clients hold back, then returns the first step outputs that arrive;
        None when ``timeout`` seconds pass or the wake-up fd fires first. Raises
        EngineDeadError when a core has died."""
        for client in self.clients:
            client._flush()
            if client._pending:
                return client._pending.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))
            ready = dict(self._poller.poll(wait * 1000))
            for client in self.clients:
                if client._inbox in ready:
                    outputs = client.receive()
                    if outputs is not None:
                        return outputs
            for client in self.clients:
                client._check_alive()
            if self._wakeup_fd in ready or (deadline is not None and time.monotonic() >= deadline):
                return None


def _stop(process, outbox, inbox, ctx, directory: str, timeout: float = 10.0) -> None:
    """Stops the core process (asked first, then terminated, then killed) and frees the sockets."""
    if process.poll() is None:
        try:
            outbox.send_multipart([SHUTDOWN], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    for stop in (None, process.terminate, process.kill):
        if process.poll() is not None:
            break
        if stop is not None:
            stop()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    outbox.close(linger=0)
    inbox.close(linger=0)
    ctx.term()
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    _directory = sys.argv[1]
    with open(f"{_directory}/config.pkl", "rb") as _f:
        _config = pickle.load(_f)
    run_engine_core(_config, f"ipc://{_directory}/input", f"ipc://{_directory}/output")
