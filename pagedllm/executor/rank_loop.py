"""A rank's side: its start (join the gloo group, load its share of the model: start_worker,
which the mp and Ray executors both use) and, for the mp executor's rank processes, the main
loop serving the engine's calls over a pipe, with the protocol both ends speak (WorkerCall in,
WorkerReply out, plain pickles)."""
from __future__ import annotations

import logging
import pickle
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Optional

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_groups import init_tp_group
from pagedllm.executor.rank_places import RankPlace
from pagedllm.memory.rank_memory import own_memory, rank_cgroup

# gloo gives up on a send or receive after this long (a stage stuck behind a dead peer)
COMM_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class WorkerCall:
    """A Worker method to run on a rank, with its arguments."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class WorkerReply:
    """What a rank's call returned, or how it failed."""

    value: Any = None
    error: Optional[str] = None  # "TypeName: message" and the rank's traceback


def send(conn: Connection, message: Any) -> None:
    """Send a message as a plain pickle."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """Receive a message sent by send()."""
    return pickle.loads(conn.recv_bytes())


def start_worker(config: EngineConfig, place: RankPlace, init_method: str,
                 num_threads: Optional[int] = None) -> Any:
    """A rank's Worker (the mp and the Ray executors both start theirs here): join the gloo
    process group at init_method and make the TP groups, set up the device, load its share of
    the model (a pipeline stage's layers, a tensor parallel rank's part of every layer, or its
    part of its stage's layers). num_threads: torch threads for the rank; None: this machine's
    share."""
    import torch.distributed as dist

    from pagedllm.worker.worker import Worker

    dist.init_process_group("gloo", init_method=init_method, rank=place.rank,
                            world_size=place.world_size, timeout=COMM_TIMEOUT)
    parallel = config.parallel
    init_tp_group(place.rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    worker = Worker(config, place.stage, place.tp, num_threads)
    worker.init_device()
    worker.load_model()
    return worker


def worker_main(conn: Connection) -> None:
    """A rank's process: take its config and place, join the process group, load its share of
    the model, then serve calls until told to stop or until the engine's end of the pipe
    closes."""
    import torch.distributed as dist

    from pagedllm.logger import configure_logging

    configure_logging()
    try:
        config, place, init_method = recv(conn)
        if place.stage is not None and rank_cgroup(place.rank) is not None:
            # its own memory: its share must fit there
            from pagedllm.memory.rank_plan import plan_rank_memory

            plan = plan_rank_memory(config, place.stage, own_memory(config.platform.memory()),
                                    config.parallel.tensor_parallel_size)
            logging.getLogger("pagedllm").info("%s", plan.summary())
        worker = start_worker(config, place, init_method)
        send(conn, WorkerReply(worker.model_runner.decode_path))
        _serve(worker, conn)
    except (EOFError, KeyboardInterrupt):
        pass  # the engine is gone (or stopping): nothing to answer
    except BaseException as err:  # start-up failed: the engine hears why
        _send_error(conn, err)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(worker: Any, conn: Connection) -> None:
    """Run calls in order until a "shutdown" call or a closed pipe."""
    while True:
        call: WorkerCall = recv(conn)
        if call.method == "shutdown":
            send(conn, WorkerReply())
            return
        try:
            reply = WorkerReply(getattr(worker, call.method)(*call.args))
        except Exception as err:
            _send_error(conn, err)
            continue
        send(conn, reply)


def _send_error(conn: Connection, err: BaseException) -> None:
    try:
        send(conn, WorkerReply(error=f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    except OSError:
        pass  # the engine closed the pipe
