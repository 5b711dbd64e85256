"""The Ray executor: one Ray actor per rank (pipeline stage or tensor parallel rank), on the
machines of a Ray cluster (vLLM's `--distributed-executor-backend ray`).

    head:   ray start --head --port=6379
    others: ray start --address=HEAD_IP:6379
    head:   RAY_ADDRESS=HEAD_IP:6379 pagedllm serve MODEL -pp 2 --distributed-executor-backend ray
            (or -tp 2)

    engine process (Ray driver)       node A: actor, rank 0      node B: actor, rank 1
    RayExecutor --actor call ------>  Worker (layers 0..k-1)
                --actor call ------------------------------->  Worker (layers k..n-1)
                                      --- torch.distributed send/recv (gloo, TCP) --->
                <-- ray.get -------------------------------------  ModelRunnerOutput

The ranks are the mp executor's (executor/rank_places.py): pipeline stages as
above, the last one's answer the step's output; or, with tensor_parallel_size=N, N ranks that
each run every step on their share of every layer, joined by the collectives (all-reduce,
all-gather), tensor parallel rank 0's answer the step's output; or both, tp x pp ranks, each
stage's TP ranks in a TP group of their own, TP rank 0 of the last stage answering. The rank
that samples is the driver; every rank learns the tokens sampled from the next step's
SchedulerOutput.

Ray places the ranks (a placement group, one bundle per rank: STRICT_SPREAD when the cluster
has a node for each, else PACK) and carries the control calls; the activations (stage to
stage, or the collectives) go over the same gloo process group and the same code as the mp
executor's, the group's address being rank 0's node IP and a free port found there. With
RAY_ADDRESS set the engine joins that cluster; else it starts a small local one, which shutdown
stops. An actor that dies fails the engine with its rank named ("tensor parallel rank 1",
"pipeline rank 0"), as a dead process does under mp; so does one that does not answer a step
within its deadline (executor/deadline.py), and every actor is then killed.

Up to pipeline_parallel_size steps are in flight, as under mp: an actor runs its calls in the
order this process submits them, so rank 0 computes step k+1 while rank 1 still computes step
k; each step's answers are Ray object refs, taken oldest step first.

pagedllm must be importable on every node (installed there, as vLLM needs too).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import (PlacementGroup, placement_group,
                                      placement_group_table, remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, WorkerDiedError, WorkerError
from pagedllm.executor.deadline import (StepDeadlines, WorkerHungError, hung_message)
from pagedllm.executor.rank_loop import start_worker
from pagedllm.executor.rank_places import (RankPlace, parallel_kind, partition_note,
                                           places_driver, rank_places)
from pagedllm.executor.step_queue import PendingStep, StepQueue
from pagedllm.memory.rank_memory import own_memory

logger = logging.getLogger("pagedllm")

PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster may take to find room for every rank
# after a rank raised, how long to look for a peer that died (the likelier cause: a rank whose
# peer is gone fails its send, receive or collective)
DEATH_GRACE_S = 5.0
PING_S = 2.0  # how long an actor that missed a step's deadline may take to answer a ping
# a local cluster's object store: the calls carry only small messages (activations go by gloo)
LOCAL_OBJECT_STORE_BYTES = 200 * 2**20
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the tracebacks it carries


@dataclass(frozen=True)
class ActorPlace:
    """Where a rank's actor runs."""

    pid: int
    node_ip: str
    package_dir: str  # the pagedllm the actor imported

    def __str__(self) -> str:
        return f"pid {self.pid} on node {self.node_ip}"


# the probe's thread of its own: a rank's calls still run one at a time, in order, on the
# default group's one thread
@ray.remote(concurrency_groups={"probe": 1})
class RankActor:
    """A rank (pipeline stage or tensor parallel rank) in a Ray actor: its Worker, once
    start() has run."""

    def __init__(self) -> None:
        self.worker: Any = None

    @ray.method(concurrency_group="probe")
    def ping(self) -> int:
        """Answered on a thread of its own, even while a call waits on a peer: an actor that
        does not answer is stopped or hung itself."""
        return os.getpid()

    def where(self) -> ActorPlace:
        """This actor's process, node and pagedllm."""
        return ActorPlace(os.getpid(), ray.util.get_node_ip_address(),
                         str(Path(__file__).parents[1]))

    def free_address(self) -> str:
        """A TCP init method for the process group: this node's IP and a port free on it."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, config: EngineConfig, place: RankPlace, init_method: str,
              num_threads: int) -> str:
        """Join the process group and load the rank's share of the model; what runs its decode
        steps."""
        from pagedllm.logger import configure_logging

        configure_logging()
        if config.rank_nodes and place.stage is not None:
            # planned against this node's memory: its share must fit here (as an mp rank in
            # its own cgroup checks)
            from pagedllm.memory.rank_plan import plan_rank_memory

            plan = plan_rank_memory(config, place.stage, own_memory(config.platform.memory()),
                                    config.parallel.tensor_parallel_size)
            logging.getLogger("pagedllm").info("%s", plan.summary())
        self.worker = start_worker(config, place, init_method, num_threads)
        return self.worker.model_runner.decode_path

    def call(self, method: str, *args: Any) -> Any:
        """Run one of the Worker's methods."""
        return getattr(self.worker, method)(*args)


@dataclass
class _Rank:
    """A rank's place in the process group, its actor, and where the actor runs."""

    place: RankPlace
    actor: Any  # ray.actor.ActorHandle
    where: Optional[ActorPlace] = None


@dataclass(frozen=True)
class _StepRefs:
    """A step in flight: its answers' refs (one a rank) and how long they may take."""

    refs: list
    deadline_s: Optional[float]


@dataclass
class _Cluster:
    """What the executor holds in Ray (module level, so weakref.finalize holds no executor)."""

    ranks: list[_Rank] = field(default_factory=list)
    group: Optional[PlacementGroup] = None
    owns_ray: bool = False  # this executor called ray.init: shutdown disconnects (or stops)


def _release(cluster: _Cluster) -> None:
    """Kill the actors, remove the placement group, leave Ray if this executor joined it;
    safe to call twice."""
    if not ray.is_initialized():
        return
    for rank in cluster.ranks:
        try:
            ray.kill(rank.actor, no_restart=True)
        except RayError:
            pass  # already gone
    cluster.ranks.clear()
    if cluster.group is not None:
        remove_placement_group(cluster.group)
        cluster.group = None
    if cluster.owns_ray:
        ray.shutdown()
        cluster.owns_ray = False


def _connect(world: int) -> bool:
    """Join the cluster at RAY_ADDRESS, or start a small local one; whether this call did
    (False: the process was already connected, and stays so)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address)
        except ConnectionError as err:
            raise RuntimeError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {err}") \
                from err
        return True
    ray.init(address="local", num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    return True


def _bundle(config: EngineConfig) -> dict[str, float]:
    """What one rank reserves: a CPU, and a GPU when the engine runs on CUDA (Ray then shows
    the actor its own GPU only)."""
    return {"CPU": 1.0, "GPU": 1.0} if config.device.type == "cuda" else {"CPU": 1.0}


def _place(world: int, bundle: dict[str, float], kind: str) -> PlacementGroup:
    """A placement group of one bundle per rank, once the cluster has found room for all."""
    nodes = [n for n in ray.nodes() if n["Alive"]
             and all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    strategy = "STRICT_SPREAD" if len(nodes) >= world else "PACK"
    group = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster found no room for {world} {kind} ranks of {bundle} each "
            f"({strategy} over {len(nodes)} nodes that could hold one) in "
            f"{PLACEMENT_TIMEOUT_S:.0f} s; free now: {ray.available_resources()}") from None
    logger.info("Ray placement group: %d bundles of %s, %s", world, bundle, strategy)
    return group


def rank_bundles(node_of: dict[int, str], planned: tuple[str, ...], world: int) -> list[int]:
    """The bundle each rank runs in (node_of: each bundle's node): one on the node its memory
    was planned on (planned[r]), else (none planned, or a cluster that changed since) the
    next in order, where the rank checks its share again before it loads."""
    free = list(range(world))
    order: dict[int, int] = {}  # rank -> bundle
    for r in range(len(planned)):
        b = next((b for b in free if node_of[b] == planned[r]), None)
        if b is not None:
            order[r] = b
            free.remove(b)
    for r in range(world):
        if r not in order:
            order[r] = free.pop(0)
            if planned:
                logger.warning("rank %d was planned on Ray node %s, but the placement group "
                               "has no bundle left there: it runs on node %s", r, planned[r],
                               node_of[order[r]])
    return [order[r] for r in range(world)]


def _threads(group: PlacementGroup, bundles: list[int]) -> list[int]:
    """Torch threads per rank (in its bundle): its node's CPUs shared among the ranks placed
    on that node."""
    node_of = placement_group_table(group)["bundles_to_node_id"]
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 1.0) for n in ray.nodes()}
    per_node = Counter(node_of[b] for b in bundles)
    return [max(1, int(cpus[node_of[b]] // per_node[node_of[b]])) for b in bundles]


def _reason(err: RayError, limit: int = 400) -> str:
    """Ray's account of a death on one line: its sentences, without the tab-indented ids."""
    text = " ".join(line.strip() for line in ANSI_COLOR.sub("", str(err)).splitlines()
                    if line.strip() and not line.startswith("\t"))
    return text if len(text) <= limit else text[:limit] + " ..."


class RayExecutor(Executor):
    """One Ray actor per rank (pipeline stage or tensor parallel rank), joined by a gloo
    process group."""

    def _init_executor(self) -> None:
        places = rank_places(self.config)
        world = len(places)
        # "tensor parallel", "pipeline parallel (VLLM_PP_LAYER_PARTITION=16,8)"
        kind = parallel_kind(places) + " parallel" + partition_note(places)
        self._driver = places_driver(places)  # TP rank 0 of the last stage samples
        self._failure: Optional[RuntimeError] = None  # once set, every call raises it again
        self._steps = StepQueue(self._take_oldest)  # steps submitted, answers untaken
        self._deadlines = StepDeadlines(self.config)
        self._cluster = _Cluster()
        self._finalizer = weakref.finalize(self, _release, self._cluster)
        self._ranks = self._cluster.ranks
        try:
            self._cluster.owns_ray = _connect(world)
            bundle = _bundle(self.config)
            self._cluster.group = group = _place(world, bundle, kind)
            bundles = rank_bundles(placement_group_table(group)["bundles_to_node_id"],
                                   self.config.rank_nodes, world)
            threads = _threads(group, bundles)
            for place in places:
                actor = RankActor.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=bundles[place.rank])).remote()
                self._ranks.append(_Rank(place, actor))
            for rank, where in zip(self._ranks, self._gather(
                    [r.actor.where.remote() for r in self._ranks])):
                rank.where = where
            init_method = self._gather([self._ranks[0].actor.free_address.remote()],
                                       self._ranks[:1])[0]
            self._decode_paths = self._gather([
                r.actor.start.remote(self.config, r.place, init_method, threads[i])
                for i, r in enumerate(self._ranks)])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s on Ray (%s): %s", kind, init_method, ", ".join(
            f"rank {r.place.rank} ({r.where}, {threads[i]} threads){r.place.layers}"
            for i, r in enumerate(self._ranks)))

    # ---- calls --------------------------------------------------------------
    def _gather(self, refs: list, ranks: Optional[list[_Rank]] = None,
                deadline_s: Optional[float] = None) -> list[Any]:
        """Each rank's answer, in rank order, taken as they come: a rank that fails is seen at
        once, even while another still waits on it in a send or receive. deadline_s: the
        longest wait for the next answer (a step's); None: no limit."""
        pending = dict(zip(refs, ranks or self._ranks))
        values: dict[int, Any] = {}
        while pending:
            started = time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=deadline_s)
            if not ready:
                self._hung(list(pending.values()), time.monotonic() - started, deadline_s)
            for ref in ready:
                rank = pending.pop(ref)
                values[rank.place.rank] = self._get(ref, rank, pending)
        return [values[r.place.rank] for r in (ranks or self._ranks)]

    def _hung(self, pending: list[_Rank], waited: float, deadline_s: float) -> None:
        """Fail the executor for actors that did not answer in time, naming one that does not
        answer a ping either (its peers only wait on it), else the first; shutdown kills every
        actor, which Ray does with SIGKILL."""
        pings = {r.actor.ping.remote(): r for r in pending}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_S)
        silent = [r for ref, r in pings.items() if ref not in ready]
        rank = (silent or pending)[0]
        where = f" ({rank.where})" if rank.where is not None else ""
        state = f" does not answer a ping in {PING_S:.0f} s either and" if silent else ""
        self._fail(WorkerHungError(hung_message(f"Ray actor of {rank.place.name}{where}",
                                                waited, deadline_s, state)))

    def _get(self, ref: Any, rank: _Rank, pending: dict) -> Any:
        """A ready answer; a rank that raised or died fails the executor."""
        try:
            return ray.get(ref)
        except RayActorError as err:
            self._died(rank, err)
        except RayTaskError as err:
            self._find_dead(pending)  # a peer's death is the better answer, when there is one
            # err is also an instance of the cause's type; its text is the rank's traceback
            cause = err.cause
            self._fail(WorkerError(f"{rank.place.name} failed: "
                                   f"{type(cause).__name__}: {cause}\n"
                                   f"{ANSI_COLOR.sub('', str(err))}"))
        except RayError as err:  # the node, the object or the owner lost
            self._died(rank, err)

    def _find_dead(self, pending: dict) -> None:
        """Fail for a rank among `pending` whose actor died, if one did within the grace."""
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayTaskError:
                continue
            except RayError as err:
                self._died(pending[ref], err)

    def _died(self, rank: _Rank, err: RayError) -> None:
        """Fail the executor for a rank whose actor is gone."""
        where = f" ({rank.where})" if rank.where is not None else ""
        self._fail(WorkerDiedError(f"Ray actor of {rank.place.name}{where} died "
                                   f"({type(err).__name__}: {_reason(err)}); the engine cannot "
                                   "continue"))

    def _fail(self, err: RuntimeError) -> None:
        """Record the failure, kill every actor and raise; later calls raise it again."""
        self._failure = err
        logger.error("%s", err)
        self.shutdown()
        raise err

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Run a Worker method on every rank (after the steps in flight); the answers in rank
        order."""
        self._check_alive()
        self._steps.drain()
        return self._gather([r.actor.call.remote(method, *args) for r in self._ranks])

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    # ---- Executor -----------------------------------------------------------
    def kv_block_bytes(self) -> int:
        # the largest stage's block: the engine divides the memory answer by it
        return max(self._call_all("kv_block_bytes"))

    def determine_available_memory(self) -> int:
        available = self._call_all("determine_available_memory")
        block_bytes = self._call_all("kv_block_bytes")
        # every stage holds the same block ids: the fewest blocks any stage can hold
        num_blocks = min(a // b for a, b in zip(available, block_bytes))
        return num_blocks * max(block_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    @property
    def max_concurrent_batches(self) -> int:
        # one step per pipeline stage; tensor parallel ranks all run every step
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def execute_model_async(self, sched: SchedulerOutput) -> PendingStep:
        self._check_alive()
        deadline_s = self._deadlines.next(sched.num_scheduled_tokens)
        return self._steps.submit(_StepRefs([  # the step's answers' refs, one a rank
            r.actor.call.remote("execute_model", sched) for r in self._ranks], deadline_s))

    def _take_oldest(self, step: "_StepRefs") -> ModelRunnerOutput:
        """The driver's answer to the oldest step in flight; an actor that died, or did not
        answer within the step's deadline, fails the executor (and so every step in flight)."""
        self._check_alive()
        return self._gather(step.refs, deadline_s=step.deadline_s)[self._driver]

    def decode_path(self) -> str:
        return self._decode_paths[self._driver]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call_all(method, *args)

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, and leave Ray if this executor
        joined it."""
        self._finalizer()

    @property
    def watches_ranks(self) -> bool:
        return self._deadlines.enabled

    @property
    def worker_places(self) -> list[ActorPlace]:
        """Where each rank's actor runs, in rank order."""
        return [r.where for r in self._ranks]
