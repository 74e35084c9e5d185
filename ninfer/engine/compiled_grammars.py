"""CompiledGrammars: the engine's output-constraint grammars compiled for its vocabulary.

Compiling precomputes which tokens each grammar state admits (about 130 ms with one thread
for a coding agent's 20 tools on the 248K vocabulary: each rule that admits most tokens costs a
pass over the vocabulary), so it runs on a worker thread (the library releases the GIL) while
the loop keeps decoding, and compiled grammars stay in an LRU keyed by OutputConstraint.key,
bounded by their memory: an agent that sends the same tools every turn compiles them once. The vocabulary index is built by the first compile.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ninfer.contract.constraint import OutputConstraint
from ninfer.frontend.grammar_library import grammar_library
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger("ninfer.engine")

DEFAULT_CACHE_BYTES = 512 << 20
# Threads one compile may use (the library splits the vocabulary between them).
MAX_COMPILE_THREADS = 8


class CompiledGrammars:
    def __init__(self, vocabulary: GrammarVocabulary, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.vocabulary = vocabulary
        self.cache_bytes = cache_bytes
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: collections.OrderedDict[str, xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.compile_seconds: dict[str, float] = {}  # by key, for the tests and the log

    def get(self, constraint: OutputConstraint) -> xgrammar.CompiledGrammar | None:
        """The compiled grammar when it is cached (now most recently used), else None."""
        with self._lock:
            compiled = self._cache.get(constraint.key)
            if compiled is not None:
                self._cache.move_to_end(constraint.key)
            return compiled

    def compile(self, constraint: OutputConstraint) -> Future:
        """A future of the compiled grammar; requests for a key already compiling share it."""
        with self._lock:
            pending = self._pending.get(constraint.key)
            if pending is not None:
                return pending
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ninfer-grammar")
            future = self._executor.submit(self._compile, constraint)
            self._pending[constraint.key] = future
            return future

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: OutputConstraint) -> xgrammar.CompiledGrammar:
        try:
            started = time.perf_counter()
            compiled = self._get_compiler().compile_grammar(constraint.grammar)
            seconds = time.perf_counter() - started
            log.debug("output grammar %s compiled in %.1f ms", constraint.key[:12], seconds * 1000)
            self._remember(constraint.key, compiled, seconds)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(constraint.key, None)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            threads = max(1, min(MAX_COMPILE_THREADS, (os.cpu_count() or 2) // 2))
            # Whole grammars are cached here; the library's own cache would keep a second copy.
            self._compiler = grammar_library().GrammarCompiler(
                self.vocabulary.info, max_threads=threads, cache_enabled=False
            )
        return self._compiler

    def _remember(self, key: str, compiled: xgrammar.CompiledGrammar, seconds: float) -> None:
        with self._lock:
            self.compile_seconds[key] = seconds
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cached_bytes += compiled.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                evicted_key, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes
                self.compile_seconds.pop(evicted_key, None)
