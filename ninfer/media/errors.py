"""MediaError: a media failure with a stable code and a message that names no field.

The caller (the API adapter) adds the field path and the HTTP status. Messages never carry media
bytes or a URL's query string, since they reach logs and clients.
"""

from __future__ import annotations


class MediaError(Exception):
    code = "invalid_media"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidMedia(MediaError):
    """The source, its bytes or the decoded content are unusable (HTTP 400)."""

    code = "invalid_media"


class MediaFetchFailed(MediaError):
    """A remote source could not be fetched: refused address, connection, HTTP status, redirects."""

    code = "media_fetch_failed"


class MediaFetchTimeout(MediaError):
    """A remote source did not connect or deliver within its timeouts."""

    code = "media_fetch_timeout"


class MediaBudgetExceeded(MediaError):
    """A preprocessing resource bound refused the item (HTTP 400)."""

    code = "media_budget_exceeded"
