"""--max-client-share: the sequences one client has in flight (n x its prompts, waiting or
running, summed over its requests) are capped at a share of --max-num-seqs, so that no client
can take every sequence slot.

A client is the peer's IP address (ASGI's scope["client"]). uvicorn takes it from
X-Forwarded-For on connections from its --forwarded-allow-ips (by default 127.0.0.1: a reverse
proxy on this machine), so clients behind a local proxy are told apart; behind a remote proxy
every client is the proxy. --api-key is one key shared by every client: it says nothing of who
sends.

Past the share a request gets 429 (OpenAI's rate-limit status, which its clients retry with
backoff) rather than waiting behind other clients' requests: the scheduler stays first-come
first-served and knows nothing of clients, nothing is held for a request that cannot start, and
the client hears at once. A request that alone exceeds the share could never start: 400.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional



class ShareRefused(Exception):
    """A request refused by ClientShares: its HTTP status (400 or 429) and the field it names."""

    def __init__(self, message: str, status: int, param: str) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class ClientShares:
    """Sequences in flight per client, each client held to max_seqs of them."""

    share: float  # of max_num_seqs, in (0, 1] (limits.SlotLimits); 1 turns the cap off
    max_num_seqs: int
    _in_flight: dict[str, int] = field(default_factory=dict, init=False)

    @property
    def max_seqs(self) -> Optional[int]:
        """Most sequences one client may have in flight; None: no cap."""
        if self.share >= 1:
            return None
        return max(1, int(self.share * self.max_num_seqs))

    def in_flight(self, client: str) -> int:
        """The client's sequences waiting or running now."""
        return self._in_flight.get(client, 0)

    def take(self, client: str, seqs: int, param: str) -> None:
        """Count seqs more for client; ShareRefused: 400 naming param if they alone pass the
        cap, 429 if they do with the client's others."""
        cap = self.max_seqs
        if cap is not None:
            limit = (f"one client may have at most {cap} sequences in flight "
                     f"(--max-client-share {self.share:g} of --max-num-seqs {self.max_num_seqs})")
            if seqs > cap:
                raise ShareRefused(f"{param}: this request asks for {seqs} sequences (n x "
                                   f"prompts); {limit}", 400, param)
            held = self.in_flight(client)
            if held + seqs > cap:
                raise ShareRefused(f"too many sequences in flight from {client}: {held} running "
                                   f"or waiting, {seqs} more asked; {limit}; retry when some "
                                   "finish", 429, "n")
        self._in_flight[client] = self.in_flight(client) + seqs

    def give_back(self, client: str, seqs: int) -> None:
        """seqs of client's have finished, failed or been aborted."""
        left = self.in_flight(client) - seqs
        if left > 0:
            self._in_flight[client] = left
        else:
            self._in_flight.pop(client, None)
