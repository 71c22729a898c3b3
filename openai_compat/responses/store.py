"""Stored responses: a bounded, in-memory LRU in each worker process.

A serverless endpoint runs many workers that share nothing, and a worker's memory goes with it when it stops or
scales down. So a stored response lives only in the worker that made it: `GET /v1/responses/{id}` and
`previous_response_id` find it only when the platform sends the request to that worker, and only until it is
evicted (the least recently used go first, past MAX_RESPONSES responses or MAX_CHARS characters of stored
conversation). A client that needs its conversations to survive sends the whole input each turn.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_RESPONSES = 1000
MAX_CHARS = 64 * 2**20  # characters of stored JSON, counted over each response's whole conversation


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was returned
    # The conversation up to and including this response: earlier input, this input, this output, as input
    # items (validated models; a continuation's list shares the items of the one it continues).
    conversation: list[Any] = field(default_factory=list)
    size: int = 0  # characters counted against MAX_CHARS


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._chars -= old.size
        self._entries[response_id] = stored
        self._chars += stored.size
        while self._entries and (len(self._entries) > self.max_responses or self._chars > self.max_chars):
            _, evicted = self._entries.popitem(last=False)
            self._chars -= evicted.size
