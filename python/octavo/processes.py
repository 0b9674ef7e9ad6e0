"""Helpers of Octavo's child processes (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path


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


# The CPUs a child process keeps to (comma-separated), where its parent shares the machine out.
CPU_AFFINITY = "OCTAVO_CPU_AFFINITY"


def keep_to_given_cpus() -> None:
    """Keeps this process, its threads and the processes it starts to the CPUs its parent gave
    it in CPU_AFFINITY, with a thread per CPU; without that variable, changes nothing."""
    listed = os.environ.pop(CPU_AFFINITY, None)
    if not listed:
        return
    import torch

    from . import set_num_threads

    cpus = {int(cpu) for cpu in listed.split(",")}
    os.sched_setaffinity(0, cpus)
    set_num_threads(len(cpus))
    torch.set_num_threads(len(cpus))


def start_python(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m module args`` with this interpreter, importing the same octavo as this
    process (its package directory first on the child's path, wherever this one found it);
    ``env``: variables to set in the child besides this process's."""
    env = {**os.environ, **(env or {})}
    root = Path(__file__).resolve().parents[1]
    if root.name not in ("site-packages", "dist-packages"):  # an installed octavo is found as it is
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
