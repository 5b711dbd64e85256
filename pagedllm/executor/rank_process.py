"""The entry of a pipeline rank's process (started by executor/multiproc.py; its loop: rank_loop.py with the engine's
sys.path): serve the engine over the socket inherited as a file descriptor."""
from __future__ import annotations

from multiprocessing.connection import Connection

from pagedllm.executor.rank_loop import worker_main


def main(fd: int) -> None:
    """Serve the engine over the socket at file descriptor fd until it says stop."""
    worker_main(Connection(fd))
