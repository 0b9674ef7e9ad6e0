"""The engine core's wire format: msgpack through msgspec, NumPy arrays zero-copy.

A message is a list of frames: the msgpack body first, then one frame per array of at least
INLINE_BYTES bytes, sent and received without copying (zmq's copy=False); smaller arrays travel
inside the body. Decoding checks each message against its dataclass (msgspec's typed decoding).
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec
import numpy as np

# Below this a frame of its own costs more than copying the bytes into the body: a frame is a
# few microseconds of ZeroMQ's time, a 16 KiB copy under one (bench/python/bench_core_ipc.py).
INLINE_BYTES = 16384


class Encoder:
    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list = []

    def encode(self, obj: Any) -> list:
        """obj -> frames (bytes, or buffers of the arrays it holds: keep obj alive until sent)."""
        self._frames = [b""]
        body = self._encoder.encode(obj)
        frames, self._frames = self._frames, []
        frames[0] = body
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            array = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)  # (which makes 0-d arrays 1-d)
            if array.nbytes < INLINE_BYTES:
                return (array.dtype.str, obj.shape, array.tobytes())
            self._frames.append(memoryview(array).cast("B"))
            return (array.dtype.str, obj.shape, len(self._frames) - 1)
        raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine core")


class Decoder:
    def __init__(self, message_type: type):
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)
        self._frames: Sequence = ()

    def decode(self, frames: Sequence) -> Any:
        """frames: bytes or zmq Frames (their buffers are read in place)."""
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._frames = ()

    def _dec_hook(self, kind: type, obj: Any) -> Any:
        if kind is np.ndarray:
            dtype, shape, data = obj
            buffer = data if isinstance(data, bytes) else _buffer(self._frames[data])
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        raise NotImplementedError(f"cannot decode {kind}")


def _buffer(frame) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame
