"""MediaInput: one prepared image or video of a prompt, as the engine receives it.

The API process acquires and prepares the media (decode, resize, patch packing) and expands
each placeholder into the item's tokens; the engine runs the vision tower over the patches
and puts its output rows in place of those tokens. Inside the engine a media token is known
by an identity id (`MediaInput.identity_ids`): a negative number derived from the item's
modality and digest (`identity_key`) and the token's index in the item, so a prompt's token
list alone says which media it holds, and prefix reuse compares media by content exactly as
it compares text.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

# Tokens per group of 2x2 merged patches.
SPATIAL_MERGE = 2
PATCH_VALUES = 3 * 2 * 16 * 16  # channels x temporal patch x patch height x patch width
# Identity ids are -(FIRST + (identity key << INDEX_BITS | index)): below PENDING_TOKEN (-1), and
# an item of up to 2**INDEX_BITS tokens (the vision envelope is 32,768 per prompt).
_FIRST_IDENTITY = 2
_INDEX_BITS = 18
_KEY_HEX_DIGITS = 11  # a 44-bit key: with the index, the id stays within int64


class MediaInput(msgspec.Struct, frozen=True):
    modality: Literal["image", "video"]
    digest: str  # SHA-256 hex of the acquired bytes; with the modality, the payload's identity
    grid_thw: tuple[int, int, int]  # patches along time, height and width (before the merge)
    # Prompt index of each frame group's first token: an image has one group; a video one per
    # temporal patch, each t=1 group its own block of grid_h * grid_w / 4 tokens.
    token_starts: list[int]
    patches: bytes  # bf16 [t * h * w, PATCH_VALUES], row-major, in the tower's 2x2-grouped order

    @property
    def tokens_per_group(self) -> int:
        _, height, width = self.grid_thw
        return height * width // (SPATIAL_MERGE * SPATIAL_MERGE)

    @property
    def num_tokens(self) -> int:
        return self.tokens_per_group * len(self.token_starts)

    @property
    def num_patches(self) -> int:
        time, height, width = self.grid_thw
        return time * height * width

    def token_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each frame group's tokens in the prompt."""
        size = self.tokens_per_group
        return [(start, start + size) for start in self.token_starts]

    @property
    def identity_key(self) -> int:
        """44 bits naming the payload (modality and digest): the part every identity id shares."""
        return identity_key(self.modality, self.digest)

    def identity_ids(self) -> list[int]:
        """The identity id of each of the item's tokens, in order."""
        base = self.identity_key << _INDEX_BITS
        return [-(_FIRST_IDENTITY + (base | index)) for index in range(self.num_tokens)]


def identity_key(modality: str, digest: str) -> int:
    return int(hashlib.sha256(f"{modality}:{digest}".encode()).hexdigest()[:_KEY_HEX_DIGITS], 16)


def identity_parts(identity_id: int) -> tuple[int, int]:
    """(identity key, token index in the item) of a media identity id."""
    value = -identity_id - _FIRST_IDENTITY
    return value >> _INDEX_BITS, value & ((1 << _INDEX_BITS) - 1)


def is_media_identity(token_id: int) -> bool:
    return token_id <= -_FIRST_IDENTITY
