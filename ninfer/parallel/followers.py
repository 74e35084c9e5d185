"""Followers: rank 0's handle on the other ranks of its engine: their processes, the group, their deaths.

Rank 0 spawns the followers itself, so the API process still sees one engine process and its
restart path is unchanged: a follower that dies fails rank 0's engine (Failed, naming the rank),
and stopping rank 0 stops them (each also gets SIGTERM from the kernel when rank 0's spawning
thread ends, like the engine process when the API process goes).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading

from ninfer.config import EngineSpec
from ninfer.log import LEVELS
from ninfer.parallel.group import RankGroup
from ninfer.parallel.commands import Stop

log = logging.getLogger("ninfer.engine")

# How long a stopping follower may take to leave before it is killed.
STOP_TIMEOUT_S = 10.0
# How often rank 0, waiting for the followers to join, checks that they are still alive.
JOIN_POLL_S = 0.2
EXIT_STATUS_WAIT_S = 5.0


class FollowerStartError(RuntimeError):
    """A follower rank failed to start (not an option's or the artifact's fault)."""


class Followers:
    def __init__(self, group: RankGroup, processes: list[multiprocessing.process.BaseProcess], rendezvous_dir: str):
        self.group = group
        self._processes = processes  # rank r at index r - 1
        self._rendezvous_dir = rendezvous_dir
        self._stopping = False
        self._serving = False  # every rank loaded its shard: the followers wait for commands
        self._leaving = False  # a rank failed to start: the followers leave on their own
        self.lost: str | None = None  # set once a follower has died: why
        self._lost_lock = threading.Lock()  # the watch thread and a failed step may both look
        self._watch = threading.Thread(target=self._watch_deaths, name="ninfer-rank-watch", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, spec: EngineSpec, device: str, log_level: int) -> Followers:
        """Spawn ranks 1..N-1 of spec.engine.tensor_parallel and join their group as rank 0 on
        `device` (rank r on the r-th device after it); log_level: rank 0's."""
        from ninfer.engine.builder import rank_device
        from ninfer.parallel.follower import follower_main

        size = spec.engine.tensor_parallel
        rendezvous_dir = tempfile.mkdtemp(prefix="ninfer-ranks-")
        rendezvous = os.path.join(rendezvous_dir, "rendezvous")
        spawn = multiprocessing.get_context("spawn")
        processes = [
            spawn.Process(
                target=follower_main,
                args=(spec, rank, rank_device(device, rank), rendezvous, follower_log_level(log_level)),
                name=f"ninfer-rank-{rank}",
            )
            for rank in range(1, size)
        ]
        for process in processes:
            process.start()
        try:
            group = _join_watching(processes, size, rendezvous, device)
        except BaseException:
            _end(processes, wait_s=0.0)
            shutil.rmtree(rendezvous_dir, ignore_errors=True)
            raise
        log.info("tensor parallel: %d ranks (followers' pids %s)", size, ", ".join(str(p.pid) for p in processes))
        return cls(group, processes, rendezvous_dir)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def send(self, command: object) -> None:
        self.group.send(command)

    def agree_started(self, error: BaseException | None) -> None:
        """Every rank says whether it loaded its shard; raises the first follower's error (its
        type kept, so an option's or the artifact's fault is still Refused) when rank 0 loaded."""
        from ninfer.parallel.group import picklable_error

        errors = self.group.gather(None if error is None else picklable_error(error))
        if error is not None or any(failure is not None for failure in errors):
            self._leaving = True  # every follower saw the failure and leaves
        if error is not None:
            return
        for rank, failure in enumerate(errors):
            if failure is not None:
                failure.args = (f"tensor-parallel rank {rank}: {failure}",)
                raise failure
        self._serving = True

    def lost_rank(self, wait_s: float = 0.0) -> str | None:
        """Why a follower is gone, waiting up to wait_s for one to be (a collective that failed on a
        closed socket may be seen before the peer's exit); None while all live."""
        if self.lost is None and wait_s > 0:
            self._note_deaths(multiprocessing.connection.wait([p.sentinel for p in self._processes], timeout=wait_s))
        return self.lost

    def _watch_deaths(self) -> None:
        ended = multiprocessing.connection.wait([p.sentinel for p in self._processes])
        if not self._stopping:
            self._note_deaths(ended)

    def _note_deaths(self, ended: list) -> None:
        """Record the first of the processes whose sentinels `ended` (their exit may still be under way)."""
        with self._lost_lock:
            for rank, process in enumerate(self._processes, start=1):
                if self.lost is None and process.sentinel in ended:
                    process.join(EXIT_STATUS_WAIT_S)  # the sentinel closes as the process exits, before its status is known
                    self.lost = f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)}"
                    log.error("%s", self.lost)

    def stop(self) -> None:
        """Stop every follower (a Stop command while they wait for commands, else signals) and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        told = self._leaving
        if self._serving and self.lost_rank() is None and all(p.is_alive() for p in self._processes):
            try:
                self.group.send(Stop())
                told = True
            except Exception:  # noqa: BLE001 - a follower died meanwhile: the signals below end the rest
                log.warning("tensor parallel: the followers did not take the stop command; ending them")
        _end(self._processes, wait_s=STOP_TIMEOUT_S if told else 0.0)
        self.group.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def _join_watching(processes: list[multiprocessing.process.BaseProcess], size: int, rendezvous: str, device: str) -> RankGroup:
    """Join the group as rank 0, failing at once if a follower dies before it joins (the join would
    otherwise wait for it until its timeout)."""
    joined: list[RankGroup | BaseException] = []

    def join() -> None:
        try:
            joined.append(RankGroup.join(0, size, rendezvous, device))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            joined.append(error)

    thread = threading.Thread(target=join, name="ninfer-rank-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_POLL_S)
        for rank, process in enumerate(processes, start=1):
            if thread.is_alive() and process.exitcode is not None:
                raise FollowerStartError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)} before it joined"
                )
    if isinstance(joined[0], BaseException):
        raise joined[0]
    return joined[0]


def follower_log_level(level: int) -> str:
    """The --log-level of a follower whose rank 0 logs at `level`: warnings and errors only, unless
    rank 0 logs debug records (a follower's info records repeat rank 0's)."""
    level = level if level <= logging.DEBUG else max(level, logging.WARNING)
    return max(((value, name) for name, value in LEVELS.items() if value <= level), default=(0, "trace"))[1]


def _end(processes: list[multiprocessing.process.BaseProcess], wait_s: float) -> None:
    """Give the processes wait_s to leave (told to stop), then SIGTERM, then SIGKILL the ones still there."""
    for process in processes:
        if wait_s and process.is_alive():
            process.join(wait_s)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its end without exiting"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"
