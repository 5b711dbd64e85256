"""--max-client-share: the sequences one client has in flight (n x its prompts, waiting or
running, summed over its requests) are capped at a share of --max-num-seqs, so that no client
can take every sequence slot.

A client is the peer's IP address (ASGI's scope["client"]). uvicorn takes it from
X-Forwarded-For on connections from its --forwarded-allow-ips (by default 127.0.0.1: a reverse
proxy on this machine), so clients behind a local proxy are told apart; behind a remote proxy
every client is the proxy. --api-key is one key shared by every client: it says nothing of who
sends.

Past the share a request waits, in its handler, until the client's own sequences finish (its
requests are admitted in the order they came); the scheduler stays first-come first-served and
knows nothing of clients, and the OpenAI client sees a slower answer, not an error. A client
whose waiting sequences pass max_waiting_seqs (--max-waiting) gets 429 (OpenAI's rate-limit
status, which its clients retry with backoff). A request that alone exceeds the share could
never start: 400.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


class ShareRefused(Exception):
    """A request refused by ClientShares: its HTTP status (400 or 429) and the field it names."""

    def __init__(self, message: str, status: int, param: str) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class ClientShares:
    """Sequences in flight per client, each client held to max_seqs of them; the event loop's
    alone (not thread-safe)."""

    share: float  # of max_num_seqs, in (0, 1] (limits.SlotLimits); 1 turns the cap off
    max_num_seqs: int
    max_waiting_seqs: int = 256  # a client's sequences waiting for its share, beyond: 429
    _in_flight: dict[str, int] = field(default_factory=dict, init=False)
    # per client, oldest first: (sequences, future resolved once they are counted in flight)
    _waiting: dict[str, deque[tuple[int, asyncio.Future]]] = field(default_factory=dict,
                                                                   init=False)

    @property
    def max_seqs(self) -> Optional[int]:
        """Most sequences one client may have in flight; None: no cap."""
        if self.share >= 1:
            return None
        return max(1, int(self.share * self.max_num_seqs))

    def in_flight(self, client: str) -> int:
        """The client's sequences waiting or running now."""
        return self._in_flight.get(client, 0)

    def waiting(self, client: str) -> int:
        """The client's sequences waiting for its share."""
        return sum(seqs for seqs, _ in self._waiting.get(client, ()))

    async def take(self, client: str, seqs: int, param: str) -> None:
        """Count seqs more for client, once its share has room (its earlier requests first);
        ShareRefused: 400 naming param if they alone pass the cap, 429 if the client already
        has max_waiting_seqs waiting. Cancelled while it waits (the client left): nothing
        counted."""
        cap = self.max_seqs
        if cap is None or (not self._waiting.get(client) and self.in_flight(client) + seqs <= cap):
            self._in_flight[client] = self.in_flight(client) + seqs
            return
        limit = (f"one client may have at most {cap} sequences in flight "
                 f"(--max-client-share {self.share:g} of --max-num-seqs {self.max_num_seqs})")
        if seqs > cap:
            raise ShareRefused(f"{param}: this request asks for {seqs} sequences (n x "
                               f"prompts); {limit}", 400, param)
        if self.waiting(client) + seqs > self.max_waiting_seqs:
            raise ShareRefused(f"too many sequences from {client}: {self.in_flight(client)} in "
                               f"flight and {self.waiting(client)} waiting for them; {limit}, "
                               f"and at most {self.max_waiting_seqs} may wait (--max-waiting); "
                               "retry when some finish", 429, "n")
        entry = (seqs, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(client, deque()).append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # admitted as it was cancelled
                self.give_back(client, seqs)
            else:
                self._drop_waiting(client, entry)
            raise

    def give_back(self, client: str, seqs: int) -> None:
        """seqs of client's have finished, failed or been aborted: admit its waiting requests
        that now fit, oldest first."""
        left = self.in_flight(client) - seqs
        if left > 0:
            self._in_flight[client] = left
        else:
            self._in_flight.pop(client, None)
        self._admit(client)

    def _admit(self, client: str) -> None:
        queue, cap = self._waiting.get(client), self.max_seqs
        while queue and (cap is None or self.in_flight(client) + queue[0][0] <= cap):
            seqs, future = queue.popleft()
            self._in_flight[client] = self.in_flight(client) + seqs
            future.set_result(None)
        if queue is not None and not queue:
            del self._waiting[client]

    def _drop_waiting(self, client: str, entry: tuple[int, asyncio.Future]) -> None:
        queue = self._waiting.get(client)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self._waiting[client]
            self._admit(client)  # a smaller request behind it may fit now
