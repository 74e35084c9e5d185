"""PromptMedia: a conversation's images and videos, acquired and prepared, then expanded into its prompt.

One path for the three protocols: their adapters leave MediaPart items (with the field path
each came from) in the Conversation; this acquires every source (data URL or HTTP(S) under the
SSRF policy), prepares them through the shared payload cache, and expands the rendered
prompt's placeholders into each item's tokens. Media errors become field-specific API errors:
400 invalid_media / media_budget_exceeded, 502 media_fetch_failed, 504 media_fetch_timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from ninfer.frontend.conversation import Conversation
from ninfer.frontend.media_expansion import MediaExpansion, VisionTokens
from ninfer.frontend.prompt_builder import PreparedPrompt, PromptError
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.media import MediaConfig, MediaError, MediaPreparer, MediaRef, Modality, PreparationStats
from ninfer.media.address_policy import AddressPolicy
from ninfer.media.fetch import FetchPolicy
from ninfer.media.preparer import preprocess_worker_count
from ninfer.server.errors import APIError

_STATUS = {"invalid_media": 400, "media_budget_exceeded": 400, "media_fetch_failed": 502, "media_fetch_timeout": 504}
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


class PromptMedia:
    def __init__(self, preparer: MediaPreparer, expansion: MediaExpansion):
        self.preparer = preparer
        self.expansion = expansion
        # One request prepares at a time (the pool works on its items in parallel); a waiting
        # request keeps its own deadline and cancellation.
        self._permit = asyncio.Lock()

    @classmethod
    def create(
        cls, tokenizer: Tokenizer, cache_mib: int, live_mib: int, threads: int, allow_private_networks: bool
    ) -> PromptMedia:
        ids = [tokenizer.token_to_id(token) for token in _VISION_TOKENS]
        if None in ids:
            missing = [token for token, i in zip(_VISION_TOKENS, ids) if i is None]
            raise ValueError(f"--vision: the tokenizer has no {', '.join(missing)} token")
        config = MediaConfig(
            cache_mib=cache_mib,
            live_mib=live_mib,
            preprocess_threads=threads,
            fetch=FetchPolicy(addresses=AddressPolicy(allow_private_networks=allow_private_networks)),
        )
        return cls(MediaPreparer(config), MediaExpansion(VisionTokens(*ids), tokenizer.encode))

    def close(self) -> None:
        self.preparer.close()

    def describe(self) -> dict[str, int | bool]:
        """server_start.vision_workspace: the bounds media are prepared under."""
        config = self.preparer.config
        limits = config.request_limits
        image, video = config.image.geometry, config.video.geometry
        # The largest single item: an image at its pixel cap, or a video whose sampled frames
        # together reach theirs (two frames a temporal group), within the prompt's envelope.
        item_tokens = min(limits.max_vision_tokens, max(
            config.image.max_pixels // image.resize_factor**2,
            config.video.max_pixels // video.resize_factor**2 // video.temporal_patch_size,
        ))
        return {
            "max_prompt_vision_tokens": limits.max_vision_tokens,
            "max_prompt_patches": limits.max_patch_rows,
            "max_item_vision_tokens": item_tokens,
            "max_item_patches": min(limits.max_patch_rows, item_tokens * image.patches_per_token),
            "media_cache_bytes": config.cache_mib << 20,
            "media_live_bytes": config.live_mib << 20,
            "preprocess_threads": preprocess_worker_count(config.preprocess_threads),
            "allow_private_networks": config.fetch.addresses.allow_private_networks,
        }

    async def prepare(
        self, conversation: Conversation, deadline_s: float | None
    ) -> tuple[list[MediaRef], dict[str, int | float]]:
        """Every media part's prepared payload, in prompt order (the caller releases them), and the
        request log's media fields. deadline_s: seconds left (the request's pending deadline)."""
        parts = conversation.media_parts
        if not parts:
            return [], {}
        stats = PreparationStats()
        try:
            async with asyncio.timeout(deadline_s):
                async with self._permit:
                    started = time.perf_counter()
                    acquired = []
                    for part in parts:
                        modality = Modality.VIDEO if part.kind == "video" else Modality.IMAGE
                        try:
                            acquired.append(await self.preparer.acquire(part.url, modality))
                        except MediaError as error:
                            raise media_error(error, part.path) from None
                    acquired_at = time.perf_counter()
                    try:
                        refs = await self.preparer.prepare(acquired, stats)
                    except MediaError as error:
                        raise media_error(error, parts[0].path if len(parts) == 1 else "messages") from None
        except TimeoutError:
            raise APIError(
                503, "the request was not admitted in time (media preparation included)", code="request_queue_timeout"
            ) from None
        record = {
            "items": len(parts),
            "acquisition_seconds": acquired_at - started,
            "preprocess_wall_seconds": time.perf_counter() - acquired_at,
            "preprocess_work_seconds": stats.work_seconds,
            "cache_hits": stats.cache_hits,
            "cache_misses": stats.cache_misses,
            "single_flight_waits": stats.single_flight_waits,
            "payload_bytes": sum(ref.media.nbytes for ref in refs),
        }
        return refs, record

    def expand(
        self, prompt: PreparedPrompt, refs: list[MediaRef], stats: dict[str, int | float], param: str
    ) -> PreparedPrompt:
        try:
            expanded = self.expansion.expand(prompt, [ref.media for ref in refs])
            return dataclasses.replace(expanded, media_stats=stats)
        except PromptError as error:
            raise APIError(400, str(error), code="invalid_prompt", param=param) from error


def media_error(error: MediaError, path: str) -> APIError:
    return APIError(_STATUS.get(error.code, 400), f"{path}: {error.message}", code=error.code, param=path)

