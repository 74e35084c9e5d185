"""Vision media preparation: acquire image/video sources, decode, smart-resize and pack BF16 patches.

Entry point for the server: MediaPreparer (acquire → prepare → MediaRef per item). Errors are
MediaError subclasses with a stable `code`; the caller adds the field path and HTTP status.
"""

from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded, MediaError, MediaFetchFailed, MediaFetchTimeout
from ninfer.media.payload import PreparedMedia
from ninfer.media.payload_cache import MediaRef
from ninfer.media.preparer import MediaConfig, MediaPreparer, PreparationStats, RequestMediaLimits
from ninfer.media.source import AcquiredMedia, Modality

__all__ = [
    "AcquiredMedia",
    "InvalidMedia",
    "MediaBudgetExceeded",
    "MediaConfig",
    "MediaError",
    "MediaFetchFailed",
    "MediaFetchTimeout",
    "MediaPreparer",
    "MediaRef",
    "Modality",
    "PreparationStats",
    "PreparedMedia",
    "RequestMediaLimits",
]
