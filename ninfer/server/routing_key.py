"""The routing key: what a router in front of several replicas needs to keep a conversation on the
replica whose context cache holds it.

Agents send a stable per-conversation value already: `prompt_cache_key` (OpenAI Chat and
Responses; Codex sets it to its session), `metadata.user_id` (Anthropic Messages; Claude Code's
carries its session). A stored Responses chain without one is keyed by its root response
(the chain's engine session key). Generation responses echo the key in the `ninfer-routing-key`
header, and Responses creates their response id in `ninfer-response-id`, so a router can stick a
`previous_response_id` follow-up to the replica that stored its parent (docs/replicas.md).
"""

from __future__ import annotations

import hashlib
import string

ROUTING_KEY_HEADER = "ninfer-routing-key"
RESPONSE_ID_HEADER = "ninfer-response-id"
_HEADER_SAFE = frozenset(string.ascii_letters + string.digits + string.punctuation)
MAX_HEADER_KEY = 256


def header_value(key: str) -> str:
    """The key as a header carries it: as sent when it is printable ASCII without spaces and at
    most MAX_HEADER_KEY characters, else "sha256:" and the hex digest of its UTF-8 bytes."""
    if len(key) <= MAX_HEADER_KEY and all(char in _HEADER_SAFE for char in key):
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
