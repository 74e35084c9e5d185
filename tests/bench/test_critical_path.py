"""Critical-path increments of a kernel timeline (what `ninfer bench --profile` tabulates)."""

import pytest

from ninfer.bench.critical_path import critical_path_increments, increments_table


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}


def test_pdl_waiting_is_not_counted_twice() -> None:
    # gemv starts early (PDL) and waits for norm; its increment is only what it adds after norm.
    events = [
        _kernel("norm", 0.0, 3.0),
        _kernel("gemv", 1.0, 22.0),  # ends at 23: adds 20
        _kernel("norm", 23.5, 2.5),  # a 0.5 gap counts to it: adds 3
        _kernel("gemv", 24.0, 21.0),  # ends at 45: adds 19
    ]
    rows = {r.name: r for r in critical_path_increments(events)}
    assert rows["gemv"].increment_us == pytest.approx(39.0) and rows["gemv"].calls == 2
    assert rows["norm"].increment_us == pytest.approx(6.0)
    assert rows["gemv"].duration_us == pytest.approx(43.0)  # durations include the waiting
    # The increments add up to the span from the first start to the last end.
    assert sum(r.increment_us for r in rows.values()) == pytest.approx(45.0)


def test_kernel_inside_an_earlier_one_adds_nothing() -> None:
    events = [_kernel("long", 0.0, 10.0), _kernel("short", 2.0, 3.0), _kernel("tail", 9.0, 4.0)]
    rows = {r.name: r for r in critical_path_increments(events)}
    assert rows["short"].increment_us == 0.0
    assert rows["tail"].increment_us == pytest.approx(3.0)


def test_table_is_per_run_and_sorted() -> None:
    events = [_kernel("a", 0.0, 1.0), _kernel("b", 1.0, 5.0), _kernel("a", 6.0, 1.0), _kernel("b", 7.0, 5.0)]
    table = increments_table(events, repeats=2)
    lines = table.splitlines()
    assert lines[0] == "critical-path increments per run (2 runs): 6.0 us in all"  # (2 + 10) / 2
    body = [line.split() for line in lines[3:]]
    assert [row[-1] for row in body] == ["b", "a"]  # largest increment first
    assert body[0][:3] == ["5.0", "5.0", "1"]  # per run: 10 us over 2 runs, 1 call each
    assert critical_path_increments([]) == []


def test_bench_profile_writes_the_increments_next_to_the_kernel_table(tmp_path, monkeypatch) -> None:
    # The plumbing of `ninfer bench --profile` on CPU (no kernels: an empty table, but every file).
    import torch

    from ninfer.bench.suite import BenchOptions, Suite

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    suite = Suite(BenchOptions(profile_dir=str(tmp_path)), device="cpu")
    suite._profile("case", lambda: torch.ones(64).sum(), 2, "runs")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["increments-case.txt", "profile-case.txt", "trace-case.json.gz"]
    text = (tmp_path / "increments-case.txt").read_text()
    assert text.startswith("case: 2 runs\ncritical-path increments per run (2 runs): 0.0 us in all")
