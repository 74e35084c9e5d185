"""The reversible compatibility envelope for reasoning that clients carry back opaque.

OpenAI's `reasoning.encrypted_content` and Anthropic's thinking `signature` are opaque
strings a client replays with later requests. NInfer has no hidden reasoning to protect:
the envelope holds the visible reasoning text itself (compressed, not encrypted), so a
replayed item whose text was dropped or omitted still renders the exact same prompt. It is
not an integrity seal: a client that edits it edits its own history, as with raw text.
"""

from __future__ import annotations

import base64
import binascii
import zlib

PREFIX = "ninfer.r1."
# Replayed envelopes are bounded like any request text; this only stops a decompression bomb.
MAX_TEXT_BYTES = 64 << 20


def seal(text: str) -> str:
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode(), 6)).decode()


def open_envelope(value: str) -> str | None:
    """The reasoning text of an envelope we issued; None for anything else (another server's
    encrypted content, a truncated or corrupted value)."""
    if not value.startswith(PREFIX):
        return None
    try:
        packed = base64.urlsafe_b64decode(value[len(PREFIX) :].encode())
        decompressor = zlib.decompressobj()
        raw = decompressor.decompress(packed, MAX_TEXT_BYTES)
        if decompressor.unconsumed_tail or not decompressor.eof:
            return None
        return raw.decode()
    except (binascii.Error, ValueError, zlib.error, UnicodeDecodeError):
        return None
