"""The server's bounds on one HTTP request (flags of `pagedllm serve`); enforced by bounded_http.
Kept free of heavy imports: the CLI reads the defaults for its help."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import DEFAULT_MAX_STREAM_BACKLOG

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a long context's text many times over
DEFAULT_READ_TIMEOUT_S = 30.0
# a stalled client is disconnected after this (nginx's send_timeout is 60 s; a sequence slot
# is dearer than a proxy's connection)
DEFAULT_SEND_STALL_TIMEOUT_S = 10.0
DEFAULT_MAX_CLIENT_SHARE = 0.5  # of --max-num-seqs (client_share)
# the kernel's send buffer per connection (SO_SNDBUF; Linux doubles it): 64 KiB in effect,
# ample for token streams (1.3 MB/s at 50 ms RTT), where autotuning would let a client that
# does not read park up to 4 MB (tcp_wmem) of its output before the server notices
DEFAULT_SEND_BUFFER_BYTES = 32 << 10


@dataclass(frozen=True)
class HttpLimits:
    """--max-request-body-bytes, --request-read-timeout, --send-stall-timeout and
    --send-buffer-bytes."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    # a client that takes no response bytes for this long (its socket full) is disconnected
    send_stall_timeout_s: float = DEFAULT_SEND_STALL_TIMEOUT_S
    send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if not self.send_stall_timeout_s > 0:
            raise ValueError(f"send_stall_timeout_s must be > 0, got {self.send_stall_timeout_s}")
        if self.send_buffer_bytes < 4096:
            raise ValueError(f"send_buffer_bytes must be >= 4096, got {self.send_buffer_bytes}")


@dataclass(frozen=True)
class SlotLimits:
    """--max-client-share and --max-stream-backlog: how long and how many sequence slots one
    client may hold."""

    max_client_share: float = DEFAULT_MAX_CLIENT_SHARE
    max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG

    def __post_init__(self) -> None:
        if not 0 < self.max_client_share <= 1:
            raise ValueError(f"max_client_share must be in (0, 1], got {self.max_client_share}")
        if self.max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be >= 1, got {self.max_stream_backlog}")
