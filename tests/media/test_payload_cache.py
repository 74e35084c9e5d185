"""The payload cache (retention, live account, references, single-flight) and the preparer around it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ninfer.media import preparer as preparer_module
from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded
from ninfer.media.payload import PreparedMedia
from ninfer.media.payload_cache import BuildClaim, Hit, PayloadCache, Wait
from ninfer.media.preparer import MediaConfig, MediaPreparer, RequestMediaLimits, preprocess_worker_count
from ninfer.media.source import AcquiredMedia, Modality
from tests.media.media_samples import image_bytes

ROW_BYTES = 1536 * 2


def payload(name: str, rows: int = 1) -> PreparedMedia:
    return PreparedMedia(Modality.IMAGE, name, (1, rows, 1), torch.zeros(rows, 1536, dtype=torch.bfloat16), None)


def build(cache: PayloadCache, name: str, rows: int = 1):
    claim = cache.begin((Modality.IMAGE, name))
    assert isinstance(claim, BuildClaim)
    media = payload(name, rows)
    reservation = cache.reserve(media.nbytes)
    ref = cache.complete(claim, media, reservation)
    reservation.release()
    return ref


def test_miss_then_hit_returns_the_same_payload():
    cache = PayloadCache(10 * ROW_BYTES, 10 * ROW_BYTES)
    first = build(cache, "a")
    first.release()
    again = cache.begin((Modality.IMAGE, "a"))
    assert isinstance(again, Hit)
    assert again.ref.media is first.media
    assert cache.live_bytes == ROW_BYTES


def test_lru_eviction_order():
    cache = PayloadCache(2 * ROW_BYTES, 10 * ROW_BYTES)
    for name in ("a", "b"):
        build(cache, name).release()
    cache.begin((Modality.IMAGE, "a")).ref.release()  # a is now the most recent
    build(cache, "c").release()
    assert [key[1] for key in cache.retained_keys()] == ["a", "c"]
    assert isinstance(cache.begin((Modality.IMAGE, "b")), BuildClaim)
    assert cache.live_bytes == 2 * ROW_BYTES


def test_a_referenced_payload_survives_eviction_and_stays_live_until_released():
    cache = PayloadCache(1 * ROW_BYTES, 10 * ROW_BYTES)
    held = build(cache, "a")
    build(cache, "b").release()  # evicts a from the cache, not from its holder
    assert [key[1] for key in cache.retained_keys()] == ["b"]
    assert cache.live_bytes == 2 * ROW_BYTES
    assert held.media.patches.shape == (1, 1536)
    shared = cache.begin((Modality.IMAGE, "a"))  # still reachable while referenced
    assert isinstance(shared, Hit) and shared.ref.media is held.media
    held.release()
    assert cache.live_bytes == 2 * ROW_BYTES  # the second holder keeps it live
    shared.ref.release()
    shared.ref.release()  # idempotent
    assert cache.live_bytes == ROW_BYTES
    assert isinstance(cache.begin((Modality.IMAGE, "a")), BuildClaim)


def test_live_budget_refuses_what_cannot_fit_and_evicts_what_it_can():
    cache = PayloadCache(4 * ROW_BYTES, 3 * ROW_BYTES)
    held = build(cache, "a", rows=2)
    build(cache, "b").release()
    assert cache.live_bytes == 3 * ROW_BYTES
    # b is unreferenced: evicted to make room; a is referenced: not enough room after that.
    reservation = cache.reserve(ROW_BYTES)
    assert [key[1] for key in cache.retained_keys()] == ["a"]
    reservation.release()
    with pytest.raises(MediaBudgetExceeded) as caught:
        cache.reserve(2 * ROW_BYTES)
    assert caught.value.code == "media_budget_exceeded"
    with pytest.raises(MediaBudgetExceeded):
        cache.reserve(4 * ROW_BYTES)  # above the limit outright
    held.release()
    cache.reserve(3 * ROW_BYTES).release()  # a is evictable now
    assert cache.live_bytes == 0


def test_zero_cache_bytes_disables_retention():
    cache = PayloadCache(0, 10 * ROW_BYTES)
    ref = build(cache, "a")
    assert cache.retained_keys() == []
    assert cache.live_bytes == ROW_BYTES
    ref.release()
    assert cache.live_bytes == 0
    assert isinstance(cache.begin((Modality.IMAGE, "a")), BuildClaim)


def test_waiters_on_a_claim_get_their_own_references():
    cache = PayloadCache(0, 10 * ROW_BYTES)
    claim = cache.begin((Modality.IMAGE, "a"))
    waiter = cache.begin((Modality.IMAGE, "a"))
    assert isinstance(waiter, Wait)
    reservation = cache.reserve(ROW_BYTES)
    builder_ref = cache.complete(claim, payload("a"), reservation)
    waiter_ref = waiter.future.result(timeout=1)
    builder_ref.release()
    assert cache.live_bytes == ROW_BYTES  # the waiter's reference keeps it live
    waiter_ref.release()
    assert cache.live_bytes == 0


def test_worker_count():
    assert 1 <= preprocess_worker_count(0) <= 16
    assert preprocess_worker_count(3) == 3
    with pytest.raises(ValueError):
        preprocess_worker_count(17)


# -- the preparer ---------------------------------------------------------------------------------


def image_item(width: int, height: int, seed: int = 0) -> AcquiredMedia:
    return AcquiredMedia(Modality.IMAGE, image_bytes(width, height, seed=seed), "image/png")


@pytest.fixture
def counted_builds(monkeypatch):
    builds = []
    original = preparer_module.prepare_image

    def slow_counted(data, settings):
        builds.append(threading.current_thread().name)
        time.sleep(0.2)  # long enough for the second request to find the build in flight
        return original(data, settings)

    monkeypatch.setattr(preparer_module, "prepare_image", slow_counted)
    return builds


def test_concurrent_identical_misses_build_once(counted_builds):
    preparer = MediaPreparer(MediaConfig(preprocess_threads=2))
    item = image_item(100, 80)

    async def two_requests():
        return await asyncio.gather(preparer.prepare([item]), preparer.prepare([item]))

    try:
        (first,), (second,) = asyncio.run(two_requests())
        assert len(counted_builds) == 1
        assert first.media is second.media
        assert first.media.grid_thw == (1, 16, 18)  # 80×100 scaled up to 256×288
        assert first.media.patches.dtype == torch.bfloat16
        first.release()
        second.release()
        (third,) = asyncio.run(preparer.prepare([item]))  # retained: a hit
        assert len(counted_builds) == 1
        third.release()
        assert preparer.cache.live_bytes == third.media.nbytes  # only the cache's retention
    finally:
        preparer.close()


def test_duplicates_in_one_request_build_once(counted_builds):
    preparer = MediaPreparer(MediaConfig(cache_mib=0, preprocess_threads=2))
    item = image_item(64, 64)
    try:
        refs = asyncio.run(preparer.prepare([item, image_item(70, 50, seed=1), item]))
        assert len(counted_builds) == 2
        assert refs[0].media is refs[2].media
        assert refs[0].media.sha256 != refs[1].media.sha256
        for ref in refs:
            ref.release()
        assert preparer.cache.live_bytes == 0
    finally:
        preparer.close()


def test_request_budgets_refuse_and_release_everything():
    limits = RequestMediaLimits(max_vision_tokens=100)  # one 256×320 image is 80 tokens
    preparer = MediaPreparer(MediaConfig(preprocess_threads=1, request_limits=limits))
    try:
        with pytest.raises(MediaBudgetExceeded):
            asyncio.run(preparer.prepare([image_item(320, 256), image_item(320, 256, seed=1)]))
        assert preparer.cache.live_bytes == 0
        (ref,) = asyncio.run(preparer.prepare([image_item(320, 256)]))  # no claim was left behind
        assert ref.media.vision_tokens() == 80
        ref.release()
    finally:
        preparer.close()


def test_a_repeated_item_counts_toward_the_vision_token_envelope_each_time():
    """The envelope bounds the prompt's media tokens: the same image twice is 160 tokens (built once),
    and a request that already holds it (a cache hit) counts it again too."""
    limits = RequestMediaLimits(max_vision_tokens=100)  # one 256×320 image is 80 tokens
    preparer = MediaPreparer(MediaConfig(preprocess_threads=1, request_limits=limits))
    try:
        with pytest.raises(MediaBudgetExceeded):
            asyncio.run(preparer.prepare([image_item(320, 256), image_item(320, 256)]))
        (held,) = asyncio.run(preparer.prepare([image_item(320, 256)]))
        with pytest.raises(MediaBudgetExceeded):
            asyncio.run(preparer.prepare([image_item(320, 256), image_item(320, 256)]))  # both hits now
        held.release()
    finally:
        preparer.close()


def test_live_limit_refuses_a_request_that_cannot_fit():
    preparer = MediaPreparer(MediaConfig(cache_mib=0, live_mib=1, preprocess_threads=1))
    try:
        # 1024×1024 pixels → 4096 rows × 3072 bytes = 12 MiB of patches, above the 1 MiB live limit.
        with pytest.raises(MediaBudgetExceeded):
            asyncio.run(preparer.prepare([image_item(1024, 1024)]))
        assert preparer.cache.live_bytes == 0
    finally:
        preparer.close()


def test_invalid_bytes_fail_the_request_with_invalid_media():
    preparer = MediaPreparer(MediaConfig(preprocess_threads=1))
    try:
        with pytest.raises(InvalidMedia):
            asyncio.run(preparer.prepare([AcquiredMedia(Modality.IMAGE, b"garbage", None), image_item(64, 64)]))
        assert preparer.cache.live_bytes == 0
    finally:
        preparer.close()


def test_cancelling_a_request_returns_its_live_bytes(counted_builds):
    preparer = MediaPreparer(MediaConfig(cache_mib=0, preprocess_threads=1))

    async def cancelled():
        task = asyncio.create_task(preparer.prepare([image_item(96, 96)]))
        await asyncio.sleep(0.05)  # the build is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(cancelled())
        time.sleep(0.4)  # the running job finishes and gives its reference back
        assert preparer.cache.live_bytes == 0
    finally:
        preparer.close()
