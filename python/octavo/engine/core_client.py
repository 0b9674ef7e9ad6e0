"""Clients of the engine core: the front end's only way to it.

InprocClient calls an EngineCore in this process: nothing is copied, and the offline LLM uses
it. MPClient (core_proc.py) talks to an EngineCore in a process of its own; DPClient
(dp_client.py) to several, one per data-parallel rank.
"""

from __future__ import annotations

from .core import EngineCore, EngineCoreConfig
from .core_messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


def make_client(config: EngineCoreConfig, multiprocess: bool, data_parallel_size: int = 1):
    """data_parallel_size > 1: that many cores, each in its own process (dp_client.py). The
    sizes are LLMEngine's, checked there."""
    if data_parallel_size > 1:
        from .dp_client import DPClient

        return DPClient(config, data_parallel_size)
    if multiprocess:
        from .core_proc import MPClient

        return MPClient(config)
    return InprocClient(config)


class InprocClient:
    def __init__(self, config: EngineCoreConfig):
        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One front-end request's samples, all or none (ValueError when the core refuses one)."""
        self.engine_core.add_samples(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def step(self, timeout: float | None = None) -> EngineCoreOutputs:
        """One core step (``timeout`` is for clients that wait on another process)."""
        return self.engine_core.step()

    def end_failed_step(self) -> EngineCoreOutputs:
        return self.engine_core.end_failed_step()

    def stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.engine_core.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
