"""The API process imports the grammar library while a long engine start runs, so the first
structured request does not wait for it; a short start leaves it to the first request that needs it."""

from __future__ import annotations

import asyncio

import pytest
import xgrammar  # noqa: F401 - imported here, so the preload's own import takes no time

from ninfer.frontend.grammar_library import grammar_library
from ninfer.server import api_process


class _Engine:
    def __init__(self, start_s: float):
        self.start_s = start_s

    async def start(self) -> None:
        await asyncio.sleep(self.start_s)


@pytest.mark.parametrize(("start_s", "imported"), [(1.0, True), (0.02, False)])
def test_a_long_engine_start_imports_the_grammar_library(monkeypatch, start_s: float, imported: bool) -> None:
    monkeypatch.setattr(api_process, "GRAMMAR_PRELOAD_AFTER_S", 0.2)
    grammar_library.cache_clear()
    try:
        asyncio.run(api_process.start_engine(_Engine(start_s)))
        assert (grammar_library.cache_info().currsize == 1) is imported
    finally:
        grammar_library()  # as other tests found it


def test_a_failed_engine_start_stops_the_preload(monkeypatch) -> None:
    class FailingEngine:
        async def start(self) -> None:
            raise RuntimeError("the engine refused to start")

    monkeypatch.setattr(api_process, "GRAMMAR_PRELOAD_AFTER_S", 0.0)
    grammar_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="refused"):
            asyncio.run(api_process.start_engine(FailingEngine()))
        assert grammar_library.cache_info().currsize == 0
    finally:
        grammar_library()
