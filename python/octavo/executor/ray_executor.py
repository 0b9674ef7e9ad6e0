"""One Ray actor per rank (tensor-parallel rank x pipeline stage), on this machine or across a
Ray cluster.

The engine joins the Ray cluster it finds (``ray.init`` already called, or RAY_ADDRESS set) or
starts a local one. A placement group reserves a bundle per rank, packed onto as few nodes as
fit, and each actor hosts the same Worker the other executors run; the ranks join one
torch.distributed group whose store listens on rank 0's node. A small step (a decode batch)
travels inside each rank's call, a large one is put in Ray's object store once and read by every
rank. An actor runs its calls in the order they were sent, so steps may be submitted before
earlier ones are answered (one per pipeline stage in flight). Every node needs Octavo installed
and the checkpoint at the same path.

As with worker processes, a rank that fails alone or dies leaves the group's collectives in an
unknown state: the executor then kills every actor and the engine reports itself dead.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..distributed.shm_all_reduce import remove_shared_files
from ..engine.core_messages import EngineDeadError
from .abstract import Executor
from .multiproc import ERROR_GRACE_SECONDS, STARTUP_SECONDS
from .step_io import StepInput, StepOutput

# A CPU rank's bundle: Ray refuses empty bundles, and a whole CPU per rank would keep a second
# engine off a small machine. The ranks' threads are sized from the node's real cores instead.
CPU_BUNDLE = 0.01
PLACEMENT_SECONDS = 300  # how long the cluster may take to find room for every rank
# Below this a step is sent inside each call: the object store's round trip costs more (2.5 ms
# against 0.3 ms per decode step with 2 ranks on the 2-core development machine).
INLINE_STEP_BYTES = 64 << 10
# Settings of what the workers compute, passed on to actors that a cluster started elsewhere
# would not give them (worker processes inherit the engine's whole environment).
WORKER_ENV = ("OCTAVO_LINEAR_CROSSOVER", "OCTAVO_BF16_TILES")

# Executors using the local cluster this module started: the last one to stop shuts it down.
_local_cluster_users = 0


class RayExecutor(Executor):
    def _start_workers(self) -> None:
        config = self.worker_config
        world = config.world_size
        self._dead: str | None = None
        self._in_flight: deque[list] = deque()  # each submitted step's answers (Ray refs), oldest first
        self.actors: list = []
        self._held = {"actors": self.actors, "group": None, "owns_cluster": _join_cluster(world),
                      "shared_memory": None}
        self._finalizer = weakref.finalize(self, _stop, self._held)
        cuda = config.device.startswith("cuda")
        bundle = {"GPU": 1} if cuda else {"CPU": CPU_BUNDLE}
        try:
            group = self._held["group"] = placement_group([bundle] * world, strategy="PACK")
            _wait_for_placement(group, world, bundle)
            env = {name: os.environ[name] for name in WORKER_ENV if name in os.environ}
            host = ray.remote(num_cpus=0, num_gpus=1 if cuda else 0,
                              runtime_env={"env_vars": env} if env else None)(RankHost)
            self.actors += [host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote() for rank in range(world)]
            self._join_group(cuda)
        except BaseException:
            self.shutdown()
            raise

    def _join_group(self, cuda: bool) -> None:
        """Creates every rank's Worker, its threads (and GPUs) shared with the ranks on its node."""
        nodes = self._gather([a.node.remote() for a in self.actors], STARTUP_SECONDS)
        spread = len({node for node, _ in nodes})
        if cuda and spread > 1:  # the Worker's device is cuda:rank, a GPU of its own node
            raise ValueError(f"distributed_executor_backend 'ray' runs GPU ranks on one node; the cluster placed "
                             f"{len(nodes)} ranks on {spread} nodes")
        init_method = self._gather([self.actors[0].group_address.remote()], STARTUP_SECONDS)[0]
        world = len(self.actors)
        # CPU ranks all on this node all-reduce through shared memory (as worker processes do).
        if not cuda and spread == 1 and nodes[0][0] == ray.get_runtime_context().get_node_id() \
                and os.path.isdir("/dev/shm"):
            self._held["shared_memory"] = f"/dev/shm/octavo-ray-{os.getpid()}-{id(self):x}"
        starts = []
        for rank, (actor, (node, _)) in enumerate(zip(self.actors, nodes)):
            neighbours = [gpus for n, gpus in nodes if n == node]  # this node's ranks, in rank order
            starts.append(actor.start.remote(self.worker_config, rank, world, init_method, len(neighbours),
                                             [g for gpus in neighbours for g in gpus], self._held["shared_memory"]))
        self._gather(starts, STARTUP_SECONDS)

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self._check_alive()
        return self._gather([a.call.remote(method, args, kwargs or {}) for a in self.actors])

    def execute_model(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.receive()

    def submit(self, step: StepInput) -> None:
        """Starts the step on every rank without waiting for it (Ray copies its arrays here, so
        the scheduler may reuse its buffers)."""
        self._check_alive()
        sent = step if _step_bytes(step) < INLINE_STEP_BYTES else ray.put(step)  # large: serialized once
        self._in_flight.append([a.execute_model.remote(sent) for a in self.actors])

    def receive(self) -> StepOutput:
        """The oldest submitted step's output: the driver rank's, the one that samples (the
        others answer None). The error every rank raised for it is raised here."""
        answers = self._gather(self._in_flight.popleft())
        return next(a for a in answers if a is not None)

    def _gather(self, refs: list, timeout: float | None = None) -> list:
        """Every rank's result, in rank order. All ranks raising alike raise that error (the
        group lives on); one rank failing alone or dying ends the executor, after at most
        ERROR_GRACE_SECONDS for the others (they may be stuck in a collective it left)."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results, errors = {}, {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as e:
                    self._fail(f"worker {rank} died: {_reason(e)}")
                except RayError as e:
                    errors[rank] = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e
                    grace = time.monotonic() + ERROR_GRACE_SECONDS
                    deadline = grace if deadline is None else min(deadline, grace)
        if len(errors) == len(refs):  # every rank failed alike: the call's error
            raise errors[0]
        if errors:
            rank, error = min(errors.items())
            self._fail(f"worker {rank} failed: {error!r}")
        if pending:
            self._fail(f"the workers did not answer within {timeout} s")
        return [results[rank] for rank in range(len(refs))]

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _fail(self, why: str) -> None:
        """Ends the group at once: a rank may be stuck in a collective and never take another
        call, so its actor is killed rather than asked to stop."""
        self._dead = why
        self.shutdown()
        raise EngineDeadError(why)

    def shutdown(self) -> None:
        """Kills the actors and frees their placement group (and the local cluster, if this
        executor started it and is the last to use it)."""
        self._finalizer()


class RankHost:
    """A Ray actor's side: hosts one rank's Worker and runs the executor's calls on it."""

    def __init__(self):
        self.worker = None

    def node(self) -> tuple[str, list[str]]:
        """(this actor's node, the GPUs Ray gave it)."""
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def group_address(self) -> str:
        """Where rank 0 (this actor) will listen for the others to join the group."""
        from ..processes import free_port

        ip = ray.util.get_node_ip_address()
        return f"tcp://{f'[{ip}]' if ':' in ip else ip}:{free_port()}"

    def start(self, config, rank: int, world: int, init_method: str, ranks_here: int, node_gpus: list[str],
              shared_memory: str | None) -> None:
        """Creates the Worker. The node's cores are shared by its ranks (as worker processes
        share a machine's); on GPUs every rank sees its node's GPUs in rank order, so that the
        Worker's device ``cuda:rank`` (``cuda:0`` for one rank) is the one Ray gave this rank."""
        import dataclasses

        import torch

        from .. import set_num_threads
        from ..worker.worker import Worker

        threads = max(1, len(os.sched_getaffinity(0)) // ranks_here)
        set_num_threads(threads)
        torch.set_num_threads(threads)
        if node_gpus:  # before this process first touches CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            config = dataclasses.replace(config, device="cuda:0")
        self.worker = Worker(config, rank, world, init_method, shared_memory)

    def call(self, method: str | Callable, args: tuple, kwargs: dict) -> Any:
        call = getattr(self.worker, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.worker, *a, **k))
        return call(*args, **kwargs)

    def execute_model(self, step: StepInput) -> StepOutput | None:
        return self.worker.execute_model(step)


def _join_cluster(world: int) -> bool:
    """Connects to the Ray cluster in use (this process's, or RAY_ADDRESS's), else starts a
    local one. True when the cluster is one this module started (its users are counted)."""
    global _local_cluster_users
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if ray.is_initialized():
        if not _local_cluster_users:  # the application's own cluster
            return False
    elif os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", **quiet)
        return False
    else:
        ray.init(address="local", num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False,
                 runtime_env=_octavo_on_path(), **quiet)
    _local_cluster_users += 1
    return True


def _octavo_on_path() -> dict | None:
    """The actors import the same octavo as this process (an installed one is found as it is;
    a source tree's folder goes first on their path)."""
    root = Path(__file__).resolve().parents[2]
    if root.name in ("site-packages", "dist-packages"):
        return None
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def _wait_for_placement(group, world: int, bundle: dict) -> None:
    try:
        ray.get(group.ready(), timeout=PLACEMENT_SECONDS)
    except GetTimeoutError:
        raise RuntimeError(f"the Ray cluster found no room for {world} ranks of {bundle} in {PLACEMENT_SECONDS} s "
                           f"(available: {ray.available_resources()})") from None


def _step_bytes(step: StepInput) -> int:
    """About how large the step is pickled: its arrays and its new requests' prompts."""
    arrays = sum(a.nbytes for a in vars(step).values() if isinstance(a, np.ndarray))
    return arrays + sum(8 * len(r.prompt_token_ids) for r in step.new_requests)


def _reason(error: RayActorError) -> str:
    """The gist of Ray's account of an actor's death (its last line's first sentence, such as
    "The actor is dead because its worker process has died."); Ray logs the rest."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1].split(". ")[0].rstrip(".") + "." if lines else type(error).__name__


def _stop(held: dict) -> None:
    global _local_cluster_users
    if held["shared_memory"]:
        remove_shared_files(held["shared_memory"])
    if held["owns_cluster"]:
        _local_cluster_users -= 1
    if not ray.is_initialized():  # Ray's own exit handler ran first: nothing is left to stop
        return
    for actor in held["actors"]:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead
            pass
    if held["group"] is not None:
        try:
            remove_placement_group(held["group"])
        except Exception:  # noqa: BLE001 - already removed
            pass
    if held["owns_cluster"] and _local_cluster_users == 0:
        ray.shutdown()
