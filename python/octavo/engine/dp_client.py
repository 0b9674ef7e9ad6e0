"""Data parallel: N engine cores, each in a process of its own with its own scheduler, KV cache
and workers (each may be tensor parallel), behind one front end. A request goes to the core
with the fewest unfinished requests (its n samples together, so that they share its prompt's
KV blocks); each core's step outputs come back as they are ready.

Each core gets devices of its own: on GPUs its ranks' GPUs (CUDA_VISIBLE_DEVICES), on the CPU
its share of this process's cores (its threads, and its workers', stay on them), so that cores
do not contend for one device.
"""

from __future__ import annotations

import os
from dataclasses import fields

from ..processes import CPU_AFFINITY
from ..speculative import SpecDecodingCounts
from .core import EngineCoreConfig
from .core_messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from .core_proc import MPClient, OutputWaiter


class DPClient:
    def __init__(self, config: EngineCoreConfig, size: int):
        self.clients: list[MPClient] = []
        try:
            for core in range(size):  # the cores load their models side by side
                self.clients.append(MPClient(config, wait=False, env=placement(config, core, size)))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.info = self.clients[0].info
        self._waiter = OutputWaiter(self.clients)
        self._core_of: dict[str, int] = {}  # unfinished core request id -> its core
        self._load = [0] * size  # unfinished core requests per core

    @property
    def scheduler(self):
        raise AttributeError(f"the {len(self.clients)} engine cores run in other processes: read LLMEngine.stats")

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        core = min(range(len(self.clients)), key=self._load.__getitem__)
        self.clients[core].add_requests(requests)
        for r in requests:
            self._core_of[r.request_id] = core
        self._load[core] += len(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self._core_of.pop(rid, None)
            if core is not None:
                by_core.setdefault(core, []).append(rid)
                self._load[core] -= 1
        for core, ids in by_core.items():
            self.clients[core].abort_requests(ids)

    def set_wakeup_fd(self, fd: int) -> None:
        self._waiter.set_wakeup_fd(fd)

    def step(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next step outputs of any core (MPClient.step's contract)."""
        outputs = self._waiter.next(timeout)
        return EngineCoreOutputs.empty(self.stats()) if outputs is None else self._finished(outputs)

    def _finished(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        for rid, reason in zip(outputs.request_ids, outputs.finish_reasons.tolist()):
            if reason:
                core = self._core_of.pop(rid, None)
                if core is not None:
                    self._load[core] -= 1
        return outputs

    def end_failed_step(self) -> EngineCoreOutputs:
        return EngineCoreOutputs.empty(self.stats())

    def stats(self) -> SchedulerStats:
        """Every core's counts added up (the KV usage: their mean)."""
        each = [client.stats() for client in self.clients]
        total = {f.name: sum(getattr(s, f.name) for s in each) for f in fields(SchedulerStats)
                 if f.name != "spec_decoding"}
        total["kv_cache_usage"] /= len(each)
        return SchedulerStats(**total, spec_decoding=SpecDecodingCounts.total([s.spec_decoding for s in each]))

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Every core's workers' results, core by core."""
        return [result for client in self.clients for result in client.collective_rpc(method, args, kwargs)]

    def reset_prefix_cache(self) -> bool:
        return all([client.reset_prefix_cache() for client in self.clients])

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


def placement(config: EngineCoreConfig, core: int, size: int, visible: list[str] | None = None) -> dict[str, str]:
    """The environment that gives data-parallel core ``core`` of ``size`` its devices: a
    contiguous run of the GPUs (``visible``: this process's, by default) or CPUs this process may
    use, as many as the core has ranks (the CPUs shared out evenly)."""
    ranks = config.worker.world_size
    if config.worker.device.startswith("cuda"):
        if config.worker.device not in ("cuda", "cuda:0"):
            raise ValueError(f"data_parallel_size > 1 gives the engine cores the GPUs in order, from the first: "
                             f"device must be 'cuda', not {config.worker.device!r}")
        if visible is None:
            import torch

            listed = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible[core * ranks:(core + 1) * ranks])}
    cpus = sorted(os.sched_getaffinity(0)) if visible is None else [int(c) for c in visible]
    share = len(cpus) // size
    return {CPU_AFFINITY: ",".join(str(c) for c in cpus[core * share:(core + 1) * share])}
