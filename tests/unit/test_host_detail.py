"""HostDetail: the slow paths never overlap, so their sum stays inside the host phases that hold them."""

from __future__ import annotations

from types import SimpleNamespace

from ninfer.engine import host_detail
from ninfer.engine.host_detail import HostDetail


def test_a_path_timed_inside_another_counts_under_the_inner_path_only(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(host_detail, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    detail = HostDetail()
    with detail.timed("admission"):
        now[0] += 1.0
        with detail.timed("context_transaction"):
            now[0] += 2.0
            with detail.timed("replica"):
                now[0] += 4.0
        detail.add("stats_publication", 8.0)
        now[0] += 8.0 + 16.0
    record = detail.take()
    assert record["detail_subset_seconds"] == {
        "admission": 17.0, "context_transaction": 2.0, "replica": 4.0, "stats_publication": 8.0,
    }
    assert sum(record["detail_subset_seconds"].values()) == now[0]
    assert record["detail_invocations"] == dict.fromkeys(host_detail.DETAILS, 1)
    assert detail.take()["detail_subset_seconds"] == dict.fromkeys(host_detail.DETAILS, 0.0)
