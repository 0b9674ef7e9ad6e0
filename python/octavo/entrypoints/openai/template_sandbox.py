"""Chat templates that a request brings (its ``chat_template`` field) render in a worker process
with limits on time, memory and output size. A template is a program: 147 bytes of nested
loops ran for 51 s, and ``{{ 'ab ' * 3000000 }}`` took half a gigabyte, inside the server. The
worker is killed when a template runs past its time, and restarted for the next request. The
model's own template, and one the operator gives with --chat-template, render in the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

# Seconds the worker may take to start (importing transformers' template helpers).
_START_TIMEOUT = 120.0
# How much of an error message travels back: a template's error may quote the whole chat.
_MAX_MESSAGE_CHARS = 500


class TemplateError(ValueError):
    """The template failed or went past a limit; the message is for the client."""


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * 4096


def _render(job: tuple) -> tuple[str, str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    conversation, chat_template, kwargs, max_chars = job
    try:
        rendered, _ = render_jinja_template(conversations=[conversation], chat_template=chat_template, **kwargs)
    except MemoryError:
        return "error", "the chat template used more memory than the server allows"
    except Exception as e:  # noqa: BLE001 - any failure of the template is reported to its author
        return "error", f"{type(e).__name__}: {e}"[:_MAX_MESSAGE_CHARS]
    text = rendered[0]
    if len(text) > max_chars:
        return "error", f"the chat template rendered {len(text)} characters, more than the limit of {max_chars}"
    return "ok", text


def _serve(memory_bytes: int) -> None:
    """The worker's loop: one job in on stdin, one (status, text) out on the original stdout."""
    import importlib
    import resource

    importlib.import_module("transformers.utils.chat_template_utils")  # up front, before the memory limit

    jobs = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the replies
    limit = _address_space_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    replies.send(("ready", ""))
    while True:
        try:
            job = jobs.recv()
        except (EOFError, OSError):
            return
        replies.send(_render(job))


class TemplateSandbox:
    """One worker process, one render at a time; ``render`` blocks, so call it off the event loop."""

    def __init__(self, timeout: float = 5.0, memory_bytes: int = 1 << 30):
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self._lock = threading.Lock()
        self._process = self._jobs = self._replies = None

    def render(self, conversation: list[dict[str, Any]], chat_template: str, kwargs: dict[str, Any],
               max_chars: int) -> str:
        with self._lock:
            jobs, replies = self._started()
            try:
                jobs.send((conversation, chat_template, kwargs, max_chars))
            except (RecursionError, TypeError, ValueError) as e:  # the request's data does not pickle
                raise TemplateError(f"the messages cannot be passed to the chat template: {e}") from None
            if not replies.poll(self.timeout):
                self._kill()
                raise TemplateError(f"the chat template did not finish within {self.timeout:g} s")
            try:
                status, text = replies.recv()
            except (EOFError, OSError):
                self._kill()
                raise TemplateError("the chat template crashed its worker (too much memory?)") from None
        if status != "ok":
            raise TemplateError(text)
        return text

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _started(self):
        if self._process is not None and self._process.poll() is None:
            return self._jobs, self._replies
        self._kill()
        # This file runs as a script in a fresh interpreter: it imports neither the server's
        # modules nor torch, and shares none of its memory.
        self._process = subprocess.Popen([sys.executable, "-I", __file__, str(self.memory_bytes)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._jobs = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._replies = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        try:
            ready = self._replies.poll(_START_TIMEOUT) and self._replies.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill()
            raise RuntimeError("the chat template worker did not start")
        return self._jobs, self._replies

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for end in (self._jobs, self._replies, self._process.stdin, self._process.stdout):
                end.close()
        self._process = self._jobs = self._replies = None


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
