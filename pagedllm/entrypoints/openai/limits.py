"""The server's bounds on one HTTP request (flags of `pagedllm serve`); enforced by bounded_http.
Kept free of heavy imports: the CLI reads the defaults for its help."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a long context's text many times over
DEFAULT_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpLimits:
    """--max-request-body-bytes and --request-read-timeout."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
