"""What the engine-core seam costs per step: one step's outputs encoded (msgspec), sent over
ZeroMQ IPC to another process and decoded there, at N decodes; and the same for a batch of N
new requests. Medians of --iterations round trips; a 1-byte ping-pong between the same two
processes is measured alongside, so the message's own cost is its round trip less half that.

python bench/python/bench_core_ipc.py [--decodes 256] [--iterations 2000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from octavo import SamplingParams
from octavo.engine.core_messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from octavo.engine.serial import Decoder, Encoder

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_peers import machine  # noqa: E402

KINDS = {b"O": EngineCoreOutputs, b"A": list[EngineCoreRequest]}


def step_outputs(n: int) -> EngineCoreOutputs:
    """A decode step of n requests with server-style ids: one new token each."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, n, dtype=np.int32)
    return EngineCoreOutputs([f"cmpl-{rng.bytes(16).hex()}-0#0" for _ in range(n)], np.arange(n + 1, dtype=np.int32),
                             tokens, np.zeros(n, np.int8), np.full(n, -1, np.int32), np.full(n, -1, np.int32),
                             stats=SchedulerStats(0, n, 0.3, 900, 5000, 1200, 0))


def new_requests(n: int) -> list[EngineCoreRequest]:
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128)
    return [EngineCoreRequest(f"cmpl-{rng.bytes(16).hex()}-0#0", rng.integers(0, 49152, 128).tolist(), params, i, 2, [])
            for i in range(n)]


def echo(directory: str) -> None:
    """The other process: decodes what arrives and answers with one byte."""
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(f"ipc://{directory}/to-echo")
    outbox.connect(f"ipc://{directory}/from-echo")
    decoders = {kind: Decoder(t) for kind, t in KINDS.items()}
    while True:
        frames = inbox.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == b"Q":
            return
        if kind in decoders:
            decoders[kind].decode(frames[1:])
        outbox.send(b"k")


def round_trips(outbox, inbox, make_frames, iterations: int, sends: list[float] | None = None) -> list[float]:
    """Round-trip times; ``sends`` gets the time each message took to encode and hand to ZeroMQ
    (what the engine core's step loop spends: it never waits for the answer)."""
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        outbox.send_multipart(make_frames(), copy=False)
        sent = time.perf_counter()
        inbox.recv()
        times.append(time.perf_counter() - start)
        if sends is not None:
            sends.append(sent - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--echo", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo:
        return echo(args.echo)
    print(f"machine: {machine()}")
    encoder = Encoder()
    messages = {b"O": step_outputs(args.decodes), b"A": new_requests(args.decodes)}
    for kind, message in messages.items():  # in one process: encode, decode
        frames = [bytes(f) for f in encoder.encode(message)]
        decoder = Decoder(KINDS[kind])
        enc = [_timed(lambda: encoder.encode(message)) for _ in range(args.iterations)]
        dec = [_timed(lambda: decoder.decode(frames)) for _ in range(args.iterations)]
        print(f"{_name(kind, args.decodes)}: {sum(len(f) for f in frames)} bytes in {len(frames)} frames; "
              f"encode {_us(enc)}, decode {_us(dec)} us (median)")
    directory = tempfile.mkdtemp(prefix="octavo-ipc-bench-")
    ctx = zmq.Context()
    outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox.bind(f"ipc://{directory}/to-echo")
    inbox.bind(f"ipc://{directory}/from-echo")
    child = subprocess.Popen([sys.executable, __file__, "--echo", directory])
    round_trips(outbox, inbox, lambda: [b"p"], 200)  # warm up the connection and the child
    ping = statistics.median(round_trips(outbox, inbox, lambda: [b"p"], args.iterations))
    print(f"1-byte ping-pong between the processes: {ping * 1e6:.1f} us round trip (median)")
    for kind, message in messages.items():
        sends = []
        rtt = statistics.median(round_trips(outbox, inbox, lambda: [kind, *encoder.encode(message)], args.iterations,
                                            sends))
        print(f"{_name(kind, args.decodes)} across the processes (encode, send, receive, decode): "
              f"{(rtt - ping / 2) * 1e6:.1f} us ({rtt * 1e6:.1f} us round trip with the 1-byte answer); "
              f"the sender's part (encode, send): {statistics.median(sends) * 1e6:.1f} us")
    outbox.send_multipart([b"Q"])
    child.wait(10)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _us(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e6:.1f}"


def _name(kind: bytes, n: int) -> str:
    return f"outputs of a step of {n} decodes" if kind == b"O" else f"{n} new requests of 128 tokens"


if __name__ == "__main__":
    main()
