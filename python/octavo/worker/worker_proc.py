"""A worker in a process of its own (``python -m octavo.worker.worker_proc DIRECTORY RANK``):
takes calls and steps from the MultiprocExecutor over ZeroMQ, answers each.

Messages in: [CALL, cloudpickle (method, args, kwargs)], [STEP, *StepInput frames], [SHUTDOWN].
Answers: [rank, OK, cloudpickle result] / [rank, OK, *StepOutput frames] (the driver rank; the
others answer [rank, OK]), or [rank, ERROR, pickled exception]. Steps are answered in the order
they came, so that the executor can keep several in flight.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

import cloudpickle
import torch
import zmq

from .. import set_num_threads
from ..engine.serial import Decoder, Encoder
from ..executor.step_io import StepInput
from ..processes import die_with_parent, pickle_error
from .worker import Worker

CALL, STEP, SHUTDOWN = b"C", b"E", b"S"
OK, ERROR = b"K", b"X"


def run_worker(directory: str, rank: int) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end handles Ctrl-C and stops us
    with open(f"{directory}/worker.pkl", "rb") as f:
        config, init_method, shared_memory = pickle.load(f)
    world = config.world_size
    threads = max(1, len(os.sched_getaffinity(0)) // world)  # the ranks share the machine's cores
    set_num_threads(threads)
    torch.set_num_threads(threads)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(f"ipc://{directory}/to-{rank}")
    outbox.connect(f"ipc://{directory}/from-workers")
    me = str(rank).encode()
    try:
        worker = Worker(config, rank, world, init_method, shared_memory)
    except BaseException as e:  # noqa: BLE001 - the executor raises it
        outbox.send_multipart([me, ERROR, pickle_error(e)])
        return
    outbox.send_multipart([me, OK, b""])
    encoder, steps = Encoder(), Decoder(StepInput)
    while True:
        frames = inbox.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == SHUTDOWN:
            return
        try:
            if kind == STEP:
                output = worker.execute_model(steps.decode(frames[1:]))
                answer = [] if output is None else encoder.encode(output)
            else:
                method, args, kwargs = cloudpickle.loads(frames[1].bytes)
                call = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
                answer = [cloudpickle.dumps(call(*args, **kwargs))]
        except BaseException as e:  # noqa: BLE001 - the executor decides what a failure means
            outbox.send_multipart([me, ERROR, pickle_error(e)])
            continue
        outbox.send_multipart([me, OK, *answer], copy=False)


if __name__ == "__main__":
    run_worker(sys.argv[1], int(sys.argv[2]))
