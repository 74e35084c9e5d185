"""PayloadCache: LRU-retained prepared payloads, a live-memory account, references and single-flight.

Two bounds. Retained bytes (payloads the cache keeps for later requests) stay within the cache
limit; eviction only drops the cache's hold. Live bytes (every payload the cache retains or any
holder references, plus reservations for builds in flight) stay within the live limit; a payload's
bytes leave the live account when its last reference goes. Reservations never wait: a miss that
cannot fit after evicting unreferenced payloads is refused with media_budget_exceeded, so builds
of concurrent requests can never hold memory while waiting on one another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from ninfer.media.errors import MediaBudgetExceeded
from ninfer.media.payload import PreparedMedia

Key = tuple  # (Modality, sha256 hex)


class ClaimAbandoned(Exception):
    """The builder gave up for a reason of its own request (not the media's): waiters should retry."""


class MediaRef:
    """One holder's reference to a live payload. release() is idempotent and thread-safe."""

    def __init__(self, cache: PayloadCache, media: PreparedMedia):
        self._cache = cache
        self.media = media
        self._released = False

    def release(self) -> None:
        self._cache._release(self)

    def __enter__(self) -> MediaRef:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Reservation:
    """Live bytes set aside for builds before they start; release() returns what was not committed."""

    def __init__(self, cache: PayloadCache, nbytes: int):
        self._cache = cache
        self.nbytes = nbytes

    def release(self) -> None:
        self._cache._unreserve(self, self.nbytes)


@dataclass
class _Entry:
    media: PreparedMedia
    references: int = 0
    retained: bool = False


@dataclass
class BuildClaim:
    """The right, and duty, to build one missing payload; identical misses wait on it."""

    key: Key
    waiters: list[Future] = field(default_factory=list)
    builder_gone: bool = False

    def wanted(self) -> bool:
        """False once the builder's request and every waiter have gone (the build may stop early)."""
        return not self.builder_gone or any(not waiter.cancelled() for waiter in self.waiters)


@dataclass(frozen=True)
class Hit:
    ref: MediaRef


@dataclass(frozen=True)
class Wait:
    future: Future  # resolves to this waiter's own MediaRef, or raises the build's MediaError


class PayloadCache:
    def __init__(self, cache_bytes_limit: int, live_bytes_limit: int):
        if cache_bytes_limit < 0 or live_bytes_limit < 0:
            raise ValueError("byte limits must not be negative")
        self.cache_bytes_limit = cache_bytes_limit
        self.live_bytes_limit = live_bytes_limit
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._retained: OrderedDict[Key, None] = OrderedDict()  # oldest use first
        self._claims: dict[Key, BuildClaim] = {}
        self._retained_bytes = 0
        self._entry_bytes = 0  # payloads retained or referenced
        self._reserved_bytes = 0

    # -- lookups and single-flight -------------------------------------------------------------------

    def begin(self, key: Key) -> Hit | Wait | BuildClaim:
        """A reference on a hit, a future when an identical build is in flight, else a claim to build."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.references += 1
                if entry.retained:
                    self._retained.move_to_end(key)
                return Hit(MediaRef(self, entry.media))
            claim = self._claims.get(key)
            if claim is not None:
                future: Future = Future()
                claim.waiters.append(future)
                return Wait(future)
            claim = BuildClaim(key)
            self._claims[key] = claim
            return claim

    def complete(self, claim: BuildClaim, media: PreparedMedia, reservation: Reservation) -> MediaRef:
        """Publish a built payload: the builder and each waiting holder get one reference."""
        if media.key != claim.key:
            raise ValueError("payload does not match its claim")
        with self._lock:
            self._take_reservation(reservation, media.nbytes)
            entry = _Entry(media)
            self._entries[claim.key] = entry
            self._entry_bytes += media.nbytes
            del self._claims[claim.key]
            entry.references += 1
            builder_ref = MediaRef(self, media)
            for waiter in claim.waiters:
                if waiter.set_running_or_notify_cancel():
                    entry.references += 1
                    waiter.set_result(MediaRef(self, media))
            self._retain(claim.key, entry)
        return builder_ref

    def fail(self, claim: BuildClaim, error: BaseException) -> None:
        """The media itself failed to build: waiters get the same error."""
        self._finish_claim(claim, error)

    def abandon(self, claim: BuildClaim) -> None:
        """The builder's request gave up (budget, cancellation): waiters retry and one of them builds."""
        self._finish_claim(claim, ClaimAbandoned())

    def _finish_claim(self, claim: BuildClaim, error: BaseException) -> None:
        with self._lock:
            if self._claims.get(claim.key) is claim:
                del self._claims[claim.key]
        for waiter in claim.waiters:
            if waiter.set_running_or_notify_cancel():
                waiter.set_exception(error)

    # -- the live account ----------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Reservation:
        """Set aside live bytes for builds, all or nothing, evicting unreferenced payloads if needed."""
        with self._lock:
            if nbytes > self.live_bytes_limit:
                raise MediaBudgetExceeded(
                    f"media needs {nbytes} bytes of preprocessing memory, above the {self.live_bytes_limit}-byte limit"
                )
            self._evict_until(lambda: self._live_bytes() + nbytes <= self.live_bytes_limit, unreferenced_only=True)
            if self._live_bytes() + nbytes > self.live_bytes_limit:
                raise MediaBudgetExceeded(
                    f"media needs {nbytes} bytes of preprocessing memory; "
                    f"{self.live_bytes_limit - self._live_bytes()} of {self.live_bytes_limit} are free"
                )
            self._reserved_bytes += nbytes
            return Reservation(self, nbytes)

    def _take_reservation(self, reservation: Reservation, nbytes: int) -> None:
        if nbytes > reservation.nbytes:
            raise ValueError(f"payload of {nbytes} bytes exceeds its reservation of {reservation.nbytes}")
        reservation.nbytes -= nbytes
        self._reserved_bytes -= nbytes

    def _unreserve(self, reservation: Reservation, nbytes: int) -> None:
        with self._lock:
            reservation.nbytes -= nbytes
            self._reserved_bytes -= nbytes

    def _live_bytes(self) -> int:
        return self._entry_bytes + self._reserved_bytes

    # -- retention -----------------------------------------------------------------------------------

    def _retain(self, key: Key, entry: _Entry) -> None:
        nbytes = entry.media.nbytes
        if nbytes > self.cache_bytes_limit:
            return
        self._evict_until(lambda: self._retained_bytes + nbytes <= self.cache_bytes_limit)
        entry.retained = True
        self._retained[key] = None
        self._retained_bytes += nbytes

    def _evict_until(self, fits, unreferenced_only: bool = False) -> None:
        """Drop the cache's hold on least recently used payloads until `fits()` (caller holds the lock).

        Freeing live bytes only helps with unreferenced payloads, so that caller skips referenced ones.
        """
        for key in list(self._retained):
            if fits():
                return
            entry = self._entries[key]
            if unreferenced_only and entry.references:
                continue
            del self._retained[key]
            entry.retained = False
            self._retained_bytes -= entry.media.nbytes
            if entry.references == 0:
                self._drop(key, entry)

    def _drop(self, key: Key, entry: _Entry) -> None:
        del self._entries[key]
        self._entry_bytes -= entry.media.nbytes

    def _release(self, ref: MediaRef) -> None:
        with self._lock:
            if ref._released:
                return
            ref._released = True
            key = ref.media.key
            entry = self._entries[key]
            entry.references -= 1
            if entry.references == 0 and not entry.retained:
                self._drop(key, entry)

    # -- observation ---------------------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return self._live_bytes()

    @property
    def retained_bytes(self) -> int:
        with self._lock:
            return self._retained_bytes

    def retained_keys(self) -> list[Key]:
        """Retained keys, least recently used first."""
        with self._lock:
            return list(self._retained)
