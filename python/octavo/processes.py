"""Helpers of Octavo's child processes (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import ctypes
import pickle
import signal
import socket
import traceback


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies, so that no engine
    core or worker outlives a killed server."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def pickle_error(e: BaseException) -> bytes:
    """The exception, to be raised again in another process (as text if it does not pickle)."""
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001
        return pickle.dumps(RuntimeError("".join(traceback.format_exception(e))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
