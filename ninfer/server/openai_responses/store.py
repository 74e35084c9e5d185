"""ResponseStore: the process-local, bounded LRU of stored Responses.

Each record keeps the terminal Response object, the normalized input Items of its request, and
its own full reconstructed Item history (the chain's inputs and outputs up to and including this
Response), so deleting or evicting an ancestor never breaks a descendant. Item dicts are shared
between records, not copied; the byte budget still charges every record for its whole history,
because that is what the record keeps alive once its ancestors are gone.

Requests with large bodies are validated on worker threads, so every method takes the lock.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


class StoreCapacityExceeded(Exception):
    """One Response is larger than the whole store (HTTP 400 response_store_capacity_exceeded)."""


def json_size(value: Any) -> int:
    """Bytes of the compact JSON encoding: the unit of the --response-store-max-mib budget."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def session_key_for(response_id: str) -> str:
    """A bounded engine session key for a stored chain root (the HTTP id itself can be long)."""
    return "responses:" + hashlib.sha256(response_id.encode()).hexdigest()[:32]


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the terminal wire object, returned by GET as is
    input_items: list[dict[str, Any]]  # normalized Items supplied to this request, client order
    history: list[dict[str, Any]]  # the chain's Items through this Response's output
    history_bytes: int  # json_size of every Item in history
    preserve_thinking: bool | None  # resolved value; children inherit it
    session_key: str | None  # engine session of the chain
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = json_size(self.response) + json_size(self.input_items) + self.history_bytes

    @property
    def id(self) -> str:
        return self.response["id"]


class ResponseStore:
    def __init__(self, max_records: int = 1024, max_bytes: int = 256 << 20):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def fits(self, size: int) -> bool:
        """Whether one record of `size` bytes can be stored at all (after evicting everything else)."""
        return self.max_records > 0 and size <= self.max_bytes

    def put(self, record: StoredResponse) -> list[str]:
        """Store `record` as the most recent one; returns the ids evicted to make room."""
        if not self.fits(record.size):
            raise StoreCapacityExceeded(
                f"the response needs {record.size} bytes of local storage; the store holds "
                f"{self.max_records} records within {self.max_bytes} bytes"
            )
        with self._lock:
            self._remove(record.id)
            self._records[record.id] = record
            self._bytes += record.size
            evicted: list[str] = []
            while len(self._records) > self.max_records or self._bytes > self.max_bytes:
                oldest = next(iter(self._records))
                self._remove(oldest)
                evicted.append(oldest)
            return evicted

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, marked as most recently used; None when absent, deleted or evicted."""
        with self._lock:
            record = self._records.get(response_id)
            if record is not None:
                self._records.move_to_end(response_id)
            return record

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self._bytes -= record.size
        return True
