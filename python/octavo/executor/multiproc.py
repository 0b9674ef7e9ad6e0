"""One worker process per tensor-parallel rank on this machine.

Each step's StepInput is encoded once and sent to every rank (ZeroMQ over IPC); the ranks run
the forward pass together (torch.distributed: gloo on the CPU, NCCL on GPUs) and rank 0 answers
with the sampled tokens. A rank that fails or dies leaves the group's collectives in an unknown
state, so either ends the executor: the engine reports itself dead rather than hang.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import tempfile
import time
import weakref
from typing import Any, Callable

import cloudpickle
import zmq

from ..engine.core_messages import EngineDeadError
from ..engine.serial import Decoder, Encoder
from ..processes import free_port, start_python
from ..worker.worker_proc import CALL, OK, SHUTDOWN, STEP
from .abstract import Executor
from .step_io import StepInput, StepOutput

POLL_SECONDS = 0.5  # how often a wait for the workers checks that they are alive
STARTUP_SECONDS = 900
# After one rank's error, how long the others may take to fail the same way (then the error is
# the call's, and the group lives on) before they count as stuck in a collective.
ERROR_GRACE_SECONDS = 2.0


class MultiprocExecutor(Executor):
    def _start_workers(self) -> None:
        world = self.worker_config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="octavo-workers-")
        with open(f"{self._dir}/worker.pkl", "wb") as f:
            pickle.dump((self.worker_config, f"tcp://127.0.0.1:{free_port()}"), f)
        self._ctx = zmq.Context()
        self._outboxes = []
        for rank in range(world):
            outbox = self._ctx.socket(zmq.PUSH)
            outbox.bind(f"ipc://{self._dir}/to-{rank}")
            self._outboxes.append(outbox)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(f"ipc://{self._dir}/from-workers")
        self.processes = [start_python("octavo.worker.worker_proc", self._dir, str(rank)) for rank in range(world)]
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._outboxes, self._inbox, self._ctx,
                                           self._dir)
        self._encoder, self._outputs = Encoder(), Decoder(StepOutput)
        try:
            self._answers(STARTUP_SECONDS)  # each worker says it has joined the group
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self._broadcast([CALL, cloudpickle.dumps((method, args, kwargs or {}))])
        return [cloudpickle.loads(frames[0].bytes) for frames in self._answers()]

    def execute_model(self, step: StepInput) -> StepOutput:
        self._broadcast([STEP, *self._encoder.encode(step)])
        return self._outputs.decode(self._answers()[0])

    def _broadcast(self, frames: list) -> None:
        self._check_alive()
        for outbox in self._outboxes:
            outbox.send_multipart(frames, copy=False)

    def _answers(self, timeout: float | None = None) -> list[list]:
        """Every rank's answer frames, in rank order. A rank's error is raised (a failed step
        first ends the executor: its ranks may be stuck in a collective)."""
        answers, errors = {}, {}
        deadline = None if timeout is None else time.monotonic() + timeout
        graced = False
        while len(answers) + len(errors) < len(self.processes):
            if errors and not graced:  # after the first error, the others get a grace period
                graced, grace = True, time.monotonic() + ERROR_GRACE_SECONDS
                deadline = grace if deadline is None else min(deadline, grace)
            if deadline is not None and time.monotonic() > deadline:
                break
            if not self._inbox.poll(POLL_SECONDS * 1000):
                self._check_alive()
                continue
            rank, status, *frames = self._inbox.recv_multipart(copy=False)
            (answers if status.bytes == OK else errors)[int(rank.bytes)] = frames
        if len(errors) == len(self.processes):  # every rank failed alike: the call's error
            raise pickle.loads(errors[0][0].bytes)
        if errors:
            rank, frames = min(errors.items())
            self._fail(f"worker {rank} failed: {pickle.loads(frames[0].bytes)!r}")
        if len(answers) < len(self.processes):
            self._fail(f"the workers did not answer within {timeout} s")
        return [answers[rank] for rank in range(len(self.processes))]

    def _check_alive(self) -> None:
        if self._dead is None:
            for rank, process in enumerate(self.processes):
                if process.poll() is not None:
                    self._fail(f"worker {rank} died (exit code {process.returncode})")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _fail(self, why: str) -> None:
        """Ends the group at once: a rank may be stuck in a collective and never read a request
        to stop."""
        self._dead = why
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        self.shutdown()
        raise EngineDeadError(why)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(processes, outboxes, inbox, ctx, directory: str, timeout: float = 10.0) -> None:
    for process, outbox in zip(processes, outboxes):
        if process.poll() is None:
            try:
                outbox.send_multipart([SHUTDOWN], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for stop in (None, "terminate", "kill"):
        alive = [p for p in processes if p.poll() is None]
        for process in alive:
            if stop is not None:
                getattr(process, stop)()
        for process in alive:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
    for socket in (*outboxes, inbox):
        socket.close(linger=0)
    ctx.term()
    shutil.rmtree(directory, ignore_errors=True)
