"""CompiledGrammars: the engine's output-constraint grammars compiled for its vocabulary.

Compiling precomputes which tokens each grammar state admits; a rule that admits most tokens
(free text, a JSON string) costs a pass over the vocabulary, about 25 ms on 248K tokens. Those
rules are the same in every answer grammar, so the library's rule cache keeps their masks across
grammars, and the first compile starts with frontend/primer_grammar.py's grammar, which holds
them all: after it, a coding agent's 20 tools compile in about 30 ms (benchmarks/
grammar_compile.py). Compiles run on a worker thread (the library releases the GIL) while the
loop keeps decoding, and compiled grammars stay in an LRU keyed by OutputConstraint.key, bounded
by their memory: an agent that sends the same tools every turn compiles them once. The
vocabulary index is built by the first compile.
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
from ninfer.frontend.primer_grammar import primer_grammar

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger("ninfer.engine")

DEFAULT_CACHE_BYTES = 512 << 20
# The library's own cache, both LRUs: rule masks (the primer's are about 1 MB on 248K tokens, and
# every compile reuses them) and recent whole grammars, the same objects this LRU holds (they cost
# memory of their own only once evicted here).
LIBRARY_CACHE_BYTES = 64 << 20
# Threads one compile may use (the library splits the vocabulary between them).
MAX_COMPILE_THREADS = 8


def compile_threads() -> int:
    return max(1, min(MAX_COMPILE_THREADS, (os.cpu_count() or 2) // 2))


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
            compiler = grammar_library().GrammarCompiler(
                self.vocabulary.info, max_threads=compile_threads(), cache_enabled=True,
                cache_limit_bytes=LIBRARY_CACHE_BYTES,
            )
            started = time.perf_counter()
            compiler.compile_grammar(primer_grammar())
            log.debug("shared grammar rules compiled in %.1f ms", (time.perf_counter() - started) * 1000)
            self._compiler = compiler
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
