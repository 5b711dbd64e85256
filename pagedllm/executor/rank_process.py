"""`python -m pagedllm.executor.rank_process FD`: one pipeline rank's process, serving the
engine over the socket inherited as file descriptor FD (executor/multiproc.py)."""
from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from pagedllm.executor.multiproc import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
