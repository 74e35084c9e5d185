"""Labels of the paths by which a request reuses a cached prefix (reported in logs and usage)."""

from __future__ import annotations

import enum


class ReusePath(str, enum.Enum):
    ROOT = "root"  # nothing reused
    PRIVATE_ENDPOINT = "private_endpoint"  # where an earlier request of the conversation stopped
    PRIVATE_TURN_CLOSURE = "private_turn_closure"  # before the open turn's first assistant opener
    PRIVATE_RESPONSE_REPLAY = "private_response_replay"  # a Responses chain's own endpoint
    PRIVATE_LONG_ANCHOR = "private_long_anchor"  # a checkpoint inside a long prompt
    SHARED_STABLE_PREFIX = "shared_stable_prefix"  # an explicit or implicit cache breakpoint

    def __str__(self) -> str:
        return self.value
