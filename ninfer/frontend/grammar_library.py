"""The grammar library (xgrammar), imported on first use.

Importing it imports transformers: about a second, and its memory, at the start of both
processes, which a server that never sees a structured-output request should not pay.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def grammar_library() -> ModuleType:
    import xgrammar

    return xgrammar
