"""Stored responses (store=true): what GET /v1/responses/{id} answers and what a
previous_response_id continues, kept in memory within a bound on entries and on bytes (the
least recently used go first), plus the responses still running, for cancel."""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    """A response object and the conversation it ends (chat messages, its output included,
    without its instructions)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    num_bytes: int = 0


@dataclass
class Running:
    """A response being generated: its object so far, and the switch cancel sets."""

    body: dict[str, Any]
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class ResponseStore:
    """An LRU of stored responses, bounded by max_entries and max_bytes (JSON bytes)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"--responses-store-{name.replace('_', '-')} must be an "
                                 f"int >= 0, got {value!r}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self.running: dict[str, Running] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """JSON bytes held."""
        return self._bytes

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a finished response (evicting the oldest past a bound); False if it alone is
        over the byte bound (it is not kept)."""
        size = len(json.dumps([body, messages], ensure_ascii=False).encode())
        rid = body["id"]
        self._drop(rid)
        if size > self.max_bytes or self.max_entries == 0:
            return False
        self._entries[rid] = StoredResponse(body, messages, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        """The stored response (now the most recently used), or None."""
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.num_bytes
