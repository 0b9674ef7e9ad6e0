"""One worker in the engine's own process: no copies, no IPC."""

from __future__ import annotations

from typing import Any, Callable

from ..worker.worker import Worker
from .abstract import Executor


class UniprocExecutor(Executor):
    def _start_workers(self) -> None:
        self.driver_worker = Worker(self.worker_config)

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        call = getattr(self.driver_worker, method) if isinstance(method, str) else \
            (lambda *a, **k: method(self.driver_worker, *a, **k))
        return [call(*args, **(kwargs or {}))]
