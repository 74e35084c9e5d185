"""MediaPreparer: a request's media, from acquired bytes to referenced BF16 payloads.

Cache misses run as decode → resize → BF16-pack jobs on a bounded thread pool; the event loop
only awaits them. A request first reads every new item's header (grid, pixels), checks its
aggregate budgets, then reserves the live bytes of all its misses at once: a request either has
everything it needs to build or is refused, so partial builds never wait on each other.
Cancelling the awaiting task (a disconnect, a deadline via asyncio.timeout) releases everything
the request held; a running job finishes for other requests waiting on it, or stops early
(videos) when nobody is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ninfer.media.errors import MediaBudgetExceeded, MediaError
from ninfer.media.fetch import FetchPolicy, Resolver
from ninfer.media.image import ImageSettings, plan_image, prepare_image
from ninfer.media.patches import PatchPlan
from ninfer.media.payload import PreparedMedia
from ninfer.media.payload_cache import BuildClaim, ClaimAbandoned, Hit, MediaRef, PayloadCache, Wait
from ninfer.media.source import AcquiredMedia, Modality, acquire_media
from ninfer.media.video import VideoSettings, plan_video, prepare_video

MIB = 1024 * 1024
MAX_PREPROCESS_THREADS = 16


def preprocess_worker_count(requested: int) -> int:
    """--media-preprocess-threads: 0 picks one worker per CPU, at most 16."""
    if not 0 <= requested <= MAX_PREPROCESS_THREADS:
        raise ValueError(f"media preprocess threads must be 0..{MAX_PREPROCESS_THREADS}, got {requested}")
    return requested or min(MAX_PREPROCESS_THREADS, os.cpu_count() or 1)


@dataclass(frozen=True)
class RequestMediaLimits:
    """Aggregate bounds over one request's items (the vision runtime's per-prompt envelope)."""

    max_source_bytes: int = 256 * MIB
    max_decoded_pixels: int = 1024 * MIB  # source pixels over all images and sampled video frames
    max_patch_rows: int = 131_072
    max_vision_tokens: int = 32_768


@dataclass(frozen=True)
class MediaConfig:
    cache_mib: int = 1024  # --media-cache-mib: LRU-retained payloads; 0 keeps none
    live_mib: int = 2048  # --media-live-mib: every retained, referenced or reserved payload
    preprocess_threads: int = 0  # --media-preprocess-threads
    image: ImageSettings = field(default_factory=ImageSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    request_limits: RequestMediaLimits = field(default_factory=RequestMediaLimits)


@dataclass
class PreparationStats:
    """One request's preparation, for the request log: how its items were served and the work."""

    cache_hits: int = 0
    cache_misses: int = 0  # built by this request
    single_flight_waits: int = 0  # joined another request's build of the same payload
    work_seconds: float = 0.0  # decode -> resize -> pack time summed over this request's builds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_work(self, seconds: float) -> None:
        with self._lock:  # the request's builds run on several pool threads
            self.work_seconds += seconds


@dataclass
class _Miss:
    claim: BuildClaim
    item: AcquiredMedia
    sha256: str
    plan: PatchPlan | None = None


class MediaPreparer:
    def __init__(self, config: MediaConfig, resolver: Resolver | None = None):
        self.config = config
        self.cache = PayloadCache(config.cache_mib * MIB, config.live_mib * MIB)
        self.worker_count = preprocess_worker_count(config.preprocess_threads)
        self._pool = ThreadPoolExecutor(self.worker_count, thread_name_prefix="media-prep")
        self._resolver = resolver

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def acquire(self, url: str, modality: Modality) -> AcquiredMedia:
        """The bytes of a data URL or an http(s) URL under the fetch policy."""
        return await acquire_media(url, modality, self.config.fetch, self._resolver)

    async def prepare(
        self, items: Sequence[AcquiredMedia], stats: PreparationStats | None = None
    ) -> list[MediaRef]:
        """One reference per item, in order. The caller releases each when the request is done.

        Raises MediaError subclasses (invalid_media, media_budget_exceeded); on any failure or
        cancellation every reference taken so far is released.
        """
        refs: list[MediaRef | None] = [None] * len(items)
        try:
            await self._prepare_into(items, refs, stats if stats is not None else PreparationStats())
        except BaseException:
            for ref in refs:
                if ref is not None:
                    ref.release()
            raise
        return refs  # type: ignore[return-value]

    async def _prepare_into(
        self, items: Sequence[AcquiredMedia], refs: list[MediaRef | None], stats: PreparationStats
    ) -> None:
        self._check_source_bytes(items)
        digests = await self._run(lambda: [hashlib.sha256(item.data).hexdigest() for item in items])
        pending = list(range(len(items)))
        # An abandoned claim (its builder's request failed for its own reasons) sends waiters round again.
        while pending:
            misses: dict[tuple, _Miss] = {}
            waits: dict[int, Future] = {}
            duplicates: list[int] = []
            for index in pending:
                item = items[index]
                key = (item.modality, digests[index])
                if key in misses:
                    duplicates.append(index)
                    continue
                outcome = self.cache.begin(key)
                if isinstance(outcome, Hit):
                    refs[index] = outcome.ref
                    stats.cache_hits += 1
                elif isinstance(outcome, Wait):
                    waits[index] = outcome.future
                    stats.single_flight_waits += 1
                else:
                    misses[key] = _Miss(outcome, item, digests[index])
                    stats.cache_misses += 1
            try:
                await self._plan_and_check(items, refs, misses, waits, digests)
                built = await self._build_all(list(misses.values()), stats)
            except BaseException:
                self._abandon_waits(waits)
                raise
            for index, ref in built.items():
                refs[_first_index(items, digests, index, pending)] = ref
            for index in duplicates:
                refs[index] = self._duplicate(refs[_first_index(items, digests, (items[index].modality, digests[index]), pending)])
            pending = []
            try:
                for index, future in waits.items():
                    try:
                        refs[index] = await _await_future(future)
                    except ClaimAbandoned:
                        pending.append(index)
            except BaseException:
                self._abandon_waits({i: f for i, f in waits.items() if refs[i] is None})
                raise

    def _duplicate(self, ref: MediaRef | None) -> MediaRef:
        outcome = self.cache.begin(ref.media.key)
        assert isinstance(outcome, Hit), "a referenced payload is always present"
        return outcome.ref

    def _check_source_bytes(self, items: Sequence[AcquiredMedia]) -> None:
        limit = self.config.request_limits.max_source_bytes
        total = sum(len(item.data) for item in items)
        if total > limit:
            raise MediaBudgetExceeded(f"request media total {total} bytes, above the {limit}-byte limit")

    async def _plan_and_check(self, items, refs, misses: dict, waits: dict, digests) -> None:
        """Header-read every item not yet prepared, then check the request's aggregate budgets."""
        to_plan = [miss.item for miss in misses.values()] + [items[index] for index in waits]
        try:
            plans = await self._run(lambda: [self._plan(item) for item in to_plan])
        except MediaError as error:
            # The header is the media's own fault; identical waiters would fail the same way.
            for miss in misses.values():
                self.cache.fail(miss.claim, error)
            raise
        except BaseException:
            for miss in misses.values():
                self.cache.abandon(miss.claim)
            raise
        for miss, plan in zip(misses.values(), plans):
            miss.plan = plan
        geometry = self.config.image.geometry
        # Patches (and vision tokens) count every item of the prompt, repeats included: the
        # envelope bounds the prompt's media tokens, though a repeated payload is built once.
        rows_by_key = {miss.claim.key: plan.patch_rows for miss, plan in zip(misses.values(), plans)}
        rows_by_key.update({(items[index].modality, digests[index]): plan.patch_rows
                            for index, plan in zip(waits, plans[len(misses):])})
        rows_by_key.update({ref.media.key: ref.media.patch_rows for ref in refs if ref is not None})
        rows = sum(rows_by_key.get((item.modality, digests[index]), 0) for index, item in enumerate(items))
        pixels = sum(plan.source_pixels for plan in plans)
        limits = self.config.request_limits
        problem = None
        if rows > limits.max_patch_rows:
            problem = f"request media need {rows} vision patches, above {limits.max_patch_rows}"
        elif rows // geometry.patches_per_token > limits.max_vision_tokens:
            problem = f"request media need {rows // geometry.patches_per_token} vision tokens, above {limits.max_vision_tokens}"
        elif pixels > limits.max_decoded_pixels:
            problem = f"request media decode to {pixels} pixels, above {limits.max_decoded_pixels}"
        if problem is not None:
            for miss in misses.values():
                self.cache.abandon(miss.claim)
            raise MediaBudgetExceeded(problem)

    def _plan(self, item: AcquiredMedia) -> PatchPlan:
        if item.modality is Modality.IMAGE:
            return plan_image(item.data, self.config.image)
        return plan_video(item.data, self.config.video).patch_plan

    async def _build_all(self, misses: list[_Miss], stats: PreparationStats) -> dict[tuple, MediaRef]:
        if not misses:
            return {}
        geometry = self.config.image.geometry
        try:
            reservation = self.cache.reserve(sum(miss.plan.patch_bytes(geometry) for miss in misses))
        except BaseException:
            for miss in misses:
                self.cache.abandon(miss.claim)
            raise
        jobs = [self._pool.submit(self._build_one, miss, reservation, stats) for miss in misses]
        built: dict[tuple, MediaRef] = {}
        try:
            for miss, job in zip(misses, jobs):
                built[miss.claim.key] = await _await_future(job, on_cancel=lambda: setattr(miss.claim, "builder_gone", True))
        except BaseException:
            for miss in misses:
                miss.claim.builder_gone = True
            for ref in built.values():
                ref.release()
            for job in jobs:
                _release_when_done(job)
            # Jobs still queued never run; their claims must not leave waiters hanging.
            for miss, job in zip(misses, jobs):
                if job.cancel():
                    self.cache.abandon(miss.claim)
            raise
        finally:
            _release_when_all_done(jobs, reservation)
        return built

    def _build_one(self, miss: _Miss, reservation, stats: PreparationStats) -> MediaRef:
        """Pool job: decode → resize → pack, then publish to the cache (and to identical waiters)."""
        item = miss.item
        started = time.perf_counter()
        try:
            if item.modality is Modality.IMAGE:
                packed = prepare_image(item.data, self.config.image)
            else:
                packed = prepare_video(item.data, self.config.video, keep_going=miss.claim.wanted)
        except MediaError as error:
            self.cache.fail(miss.claim, error)
            raise
        except BaseException:
            self.cache.abandon(miss.claim)
            raise
        finally:
            stats.add_work(time.perf_counter() - started)
        media = PreparedMedia(item.modality, miss.sha256, packed.grid_thw, packed.patches, packed.timestamps_s)
        return self.cache.complete(miss.claim, media, reservation)

    def _abandon_waits(self, waits: dict[int, Future]) -> None:
        for future in waits.values():
            _release_when_done(future)

    async def _run(self, function):
        return await asyncio.wrap_future(self._pool.submit(function))


def _first_index(items, digests, key, pending) -> int:
    for index in pending:
        if (items[index].modality, digests[index]) == key:
            return index
    raise KeyError(key)


async def _await_future(future: Future, on_cancel=None):
    """Await a concurrent future without cancelling it: others (the cache, waiters) depend on its end."""
    try:
        return await asyncio.shield(asyncio.wrap_future(future))
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        raise


def _release_when_done(future: Future) -> None:
    """Whoever stopped waiting still owns the reference the future delivers: give it back."""
    if future.cancel():
        return

    def release(done: Future) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().release()

    future.add_done_callback(release)


def _release_when_all_done(jobs: list[Future], reservation) -> None:
    """The request's unused reservation goes back once no job of it can still commit."""
    remaining = [len(jobs)]

    def one_done(_: Future) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            reservation.release()

    for job in jobs:
        job.add_done_callback(one_done)
