"""MediaInput: identity ids, spans, and the crossing to the engine process (msgpack)."""

from __future__ import annotations

from ninfer.contract.media import PATCH_VALUES, MediaInput, identity_parts, is_media_identity
from ninfer.contract.messages import AddRequest, decode_to_engine, encode
from ninfer.contract.request import EngineRequest
from ninfer.engine.scheduler import PENDING_TOKEN


def item(digest: str, modality: str = "image", grid=(2, 4, 6), starts=(10, 30)) -> MediaInput:
    t, h, w = grid
    return MediaInput(modality, digest, grid, list(starts), bytes(range(256)) * (t * h * w * PATCH_VALUES * 2 // 256))


def test_identity_ids_name_the_item_and_the_index_and_stay_clear_of_real_and_pending_ids():
    video = item("ab" * 32, "video")
    ids = video.identity_ids()
    assert len(ids) == video.num_tokens == 2 * 6 and video.token_spans() == [(10, 16), (30, 36)]
    assert all(is_media_identity(i) and i < PENDING_TOKEN for i in ids) and not is_media_identity(PENDING_TOKEN)
    assert [identity_parts(i) for i in ids] == [(video.identity_key, index) for index in range(12)]
    assert len(set(ids)) == len(ids)
    # Another payload, or the same bytes as the other modality, is another item.
    assert not set(ids) & set(item("cd" * 32, "video").identity_ids())
    assert not set(ids) & set(item("ab" * 32, "image").identity_ids())


def test_a_request_with_media_crosses_to_the_engine_process_unchanged():
    request = EngineRequest("r", [1, 2, 3], media=[item("ef" * 32)])
    decoded = decode_to_engine(encode(AddRequest(request)))
    assert decoded.request == request and decoded.request.media[0].patches == request.media[0].patches
