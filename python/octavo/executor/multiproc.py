"""One worker process per rank (tensor-parallel rank x pipeline stage) on this machine.

Each step's StepInput is encoded once and sent to every rank (ZeroMQ over IPC); the ranks run
the forward pass together (torch.distributed: gloo on the CPU, NCCL on GPUs) and the driver rank
answers with the sampled tokens. Steps may be submitted before earlier ones are answered (one
per pipeline stage in flight): every rank runs and answers them in order. A rank that fails or
dies leaves the group's collectives in an unknown state, so either ends the executor: the engine
reports itself dead rather than hang.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import tempfile
import time
import weakref
from collections import deque
from typing import Any, Callable

import cloudpickle
import zmq

from ..distributed.shm_all_reduce import remove_shared_files
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
        world = self.worker_config.world_size
        self._dir = tempfile.mkdtemp(prefix="octavo-workers-")
        # The ranks' all-reduce meets in memory-backed files where the machine has /dev/shm.
        self._shm_prefix = f"/dev/shm/{os.path.basename(self._dir)}" if os.path.isdir("/dev/shm") else \
            f"{self._dir}/all-reduce"
        with open(f"{self._dir}/worker.pkl", "wb") as f:
            pickle.dump((self.worker_config, f"tcp://127.0.0.1:{free_port()}", self._shm_prefix), f)
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
                                           self._dir, self._shm_prefix)
        self._encoder, self._outputs = Encoder(), Decoder(StepOutput)
        self._unanswered = 0  # steps submitted whose answers are not read yet
        # A rank may answer a later step before another rank answers an earlier one: its later
        # answers wait here for their turn.
        self._early: list[deque] = [deque() for _ in range(world)]
        try:
            self._answers(STARTUP_SECONDS)  # each worker says it has joined the group
        except BaseException:
            self.shutdown()
            raise
        shutil.rmtree(self._dir, ignore_errors=True)  # connected: nothing is left to leak on a SIGKILL

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        while self._unanswered:  # the steps' answers come first: keep them for receive()
            self._landed.append(self._read_step())
        self._broadcast([CALL, cloudpickle.dumps((method, args, kwargs or {}))])
        return [cloudpickle.loads(frames[0].bytes) for frames in self._answers()]

    def execute_model(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.receive()

    def submit(self, step: StepInput) -> None:
        """Sends the step. Its arrays travel zero-copy when large: they must not change until it
        is answered (the engine core copies the scheduler's buffers when steps overlap)."""
        self._broadcast([STEP, *self._encoder.encode(step)])
        self._unanswered += 1

    def receive(self) -> StepOutput:
        result = self._landed.popleft() if self._landed else self._read_step()
        if isinstance(result, Exception):
            raise result
        return result

    def _read_step(self) -> StepOutput | Exception:
        """The oldest unanswered step's output, or the error every rank raised for it."""
        self._unanswered -= 1
        try:
            return self._outputs.decode(self._answers()[self.driver_rank])
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - the step's error, raised in its turn
            return e

    def _broadcast(self, frames: list) -> None:
        self._check_alive()
        for outbox in self._outboxes:
            outbox.send_multipart(frames, copy=False)

    def _answers(self, timeout: float | None = None) -> list[list]:
        """Every rank's answer frames, in rank order. A rank's error is raised (a failed step
        first ends the executor: its ranks may be stuck in a collective)."""
        answers, errors = {}, {}
        for rank, early in enumerate(self._early):
            if early:
                status, frames = early.popleft()
                (answers if status == OK else errors)[rank] = frames
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
            rank = int(rank.bytes)
            if rank in answers or rank in errors:  # its answer to a later step
                self._early[rank].append((status.bytes, frames))
                continue
            (answers if status.bytes == OK else errors)[rank] = frames
        if len(errors) == len(self.processes):  # every rank failed alike: the call's error
            raise pickle.loads(errors[0][0].bytes)
        if errors:
            self._check_alive()  # a rank that died is why its peers' collectives failed
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


def _stop(processes, outboxes, inbox, ctx, directory: str, shm_prefix: str, timeout: float = 10.0) -> None:
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
    remove_shared_files(shm_prefix)  # the ranks' all-reduce files, whatever ended them
