"""The executor: the engine's only way to a model. It owns the workers (one per rank), sizes
their KV caches and runs each step on them."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from .configs import CacheConfig, WorkerConfig
from .step_io import StepInput, StepOutput


class Executor:
    """Subclasses say where the workers live (``collective_rpc``) and start them."""

    def __init__(self, worker_config: WorkerConfig):
        self.worker_config = worker_config
        self.kv_block_bytes = 0  # bytes one KV block takes on each worker, once sized
        # The worker whose StepOutput counts: the last pipeline stage's first tensor-parallel rank.
        self.driver_rank = (worker_config.pipeline_parallel_size - 1) * worker_config.tensor_parallel_size
        self._landed: deque[StepOutput | Exception] = deque()  # submitted steps' results, oldest first
        self._start_workers()
        try:
            self.collective_rpc("load_model")
            self.model_config, self.model_dtype, self.kv_groups = self.collective_rpc("model_summary")[0]
        except BaseException:  # a model the workers cannot load: they stop here, not at exit
            self.shutdown()
            raise

    @staticmethod
    def create(worker_config: WorkerConfig, backend: str | None = None) -> Executor:
        """The executor for ``distributed_executor_backend``: "uni" (one worker in this
        process), "mp" (a process per rank), "ray" (a Ray actor per rank, on this machine or a
        Ray cluster); None: "mp" for more than one rank, else "uni"."""
        from .uniproc import UniprocExecutor

        if backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {backend!r}")
        if backend == "uni" and worker_config.world_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank; use 'mp' for tensor_parallel_size or "
                             "pipeline_parallel_size > 1")
        if backend == "ray":
            from .ray_executor import RayExecutor  # Ray is optional: imported only when asked for

            return RayExecutor(worker_config)
        if backend == "mp" or worker_config.world_size > 1:
            from .multiproc import MultiprocExecutor  # pyzmq: only where worker processes run

            return MultiprocExecutor(worker_config)
        return UniprocExecutor(worker_config)

    def _start_workers(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Calls ``method`` on every worker (a Worker method's name, or a function taking the
        worker first) and returns each worker's result, in rank order."""
        raise NotImplementedError

    def determine_num_blocks(self, cache: CacheConfig) -> int:
        """As many KV blocks as every worker can hold: the least of their answers."""
        sizes = self.collective_rpc("kv_cache_bytes", (cache,))
        self.kv_block_bytes = max(block for _, block in sizes)
        num_blocks = min(budget // block for budget, block in sizes)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={min(b for b, _ in sizes)} holds no KV block; give at least "
                             f"{2 * self.kv_block_bytes} bytes")
        return num_blocks

    def initialize_cache(self, num_blocks: int, cache: CacheConfig) -> None:
        self.collective_rpc("initialize_cache", (num_blocks, cache))

    def execute_model(self, step: StepInput) -> StepOutput:
        """Runs one step on every worker; returns the driver's output. Raises when the forward
        pass fails on any worker (none of the step's KV is to be trusted then)."""
        return self.collective_rpc("execute_model", (step,))[self.driver_rank]

    def submit(self, step: StepInput) -> None:
        """Starts a step; ``receive`` returns the results of submitted steps, oldest first.
        Executors that can keep several steps in flight (pipeline stages) override both; here the
        step runs at once. A step's failure is raised by its ``receive``; EngineDeadError at once."""
        from ..engine.core_messages import EngineDeadError  # the engine package imports this one

        try:
            self._landed.append(self.execute_model(step))
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - receive() raises it, in its step's turn
            self._landed.append(e)

    def receive(self) -> StepOutput:
        result = self._landed.popleft()
        if isinstance(result, Exception):
            raise result
        return result

    def shutdown(self) -> None:
        """Stops the workers (nothing to do in-process)."""
