"""A follower rank's process: load its shard, then repeat rank 0's runner calls until told to stop.

It schedules nothing: every step arrives as rank 0's SchedulerStep (commands.py), so its pools
hold the same pages and slots. Any failure here ends the process: rank 0 sees the rank die and
fails its engine, which the API process restarts with every rank.
"""

from __future__ import annotations

import collections
import gc
import logging
import signal
import time

import torch

from ninfer.config import EngineSpec
from ninfer.engine.deferred_sampling import DeferredSampling
from ninfer.engine.pending_step import PendingStep
from ninfer.engine.runner import ModelRunner
from ninfer.engine.step_readback import MAX_UNREAD_STEPS
from ninfer.parallel.commands import AgreeKvTokens, CreateRunner, Launch, ReportMemory, SampleDeferred, Stop
from ninfer.parallel.group import RankGroup, picklable_error

log = logging.getLogger("ninfer.engine")


def follower_main(spec: EngineSpec, rank: int, device: str, rendezvous: str, log_level: str) -> None:
    """Entry point of rank `rank`'s process on `device` (spawned by rank 0: parallel/followers.py).
    It joins the ranks' groups first, so that any later failure reaches rank 0 through them."""
    from ninfer.engine.background_imports import start_background_imports, wait_for_background_imports
    from ninfer.engine.builder import load_trunk, open_checked, quantize_drafter_at_load
    from ninfer.engine.process import die_with_parent
    from ninfer.log import setup_logging
    from ninfer.parallel.partial_sums import reduce_partial_sums
    from ninfer.parallel.shard_plan import ShardPlan

    die_with_parent()
    # The terminal's Ctrl-C reaches the whole process group; rank 0 decides the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(log_level)
    started = time.perf_counter()
    start_background_imports()
    group = RankGroup.join(rank, spec.engine.tensor_parallel, rendezvous, device)
    error = None
    model = draft_model = vision_tower = None
    try:
        engine, artifact, companion = open_checked(spec, rank)
        plan = ShardPlan(artifact.config, rank, engine.tensor_parallel)
        model, dtype = load_trunk(spec, engine, artifact, started, plan, announce=False)
        reduce_partial_sums(model, group)
        # A DFlash drafter and the vision tower run whole on every rank, as on rank 0.
        if companion is not None:
            draft_model = companion.load_model(dtype=dtype, device=engine.device)
        quantize_drafter_at_load(engine, model, draft_model)
        if engine.vision:
            from ninfer.models.vision_loader import load_vision_tower

            vision_tower = load_vision_tower(artifact, device=engine.device, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which reports the start-up failure
        log.debug("rank %d failed to start", rank, exc_info=True)
        error = picklable_error(exc)
    if not any(failure is not None for failure in group.gather(error)):
        Follower(group, model, draft_model, vision_tower).serve()
    group.close()
    wait_for_background_imports()  # an import cut off at exit would print its traceback
    # Rank 0 waits for its followers to leave (before a restart starts new ones): left to the
    # collector, the interpreter's last passes over torch's objects take seconds on a small CPU.
    gc.freeze()


class Follower:
    def __init__(self, group: RankGroup, model, draft_model=None, vision_tower=None):
        self.group = group
        self.model = model
        self.draft_model = draft_model
        self.vision_tower = vision_tower
        self.runner: ModelRunner | None = None
        self._unread: collections.deque[PendingStep] = collections.deque()  # launched, oldest first
        self._deferred: DeferredSampling | None = None

    def serve(self) -> None:
        while True:
            command = self.group.receive()
            if isinstance(command, Stop):
                return
            if isinstance(command, Launch):
                self._make_room()
                launched = self.runner.launch(command.step)
                if isinstance(launched, DeferredSampling):
                    self._deferred = launched
                else:
                    self._unread.append(launched)
            elif isinstance(command, SampleDeferred):
                self._make_room()
                self._unread.append(self.runner.sample_deferred(self._deferred, command.masks))
                self._deferred = None
            elif isinstance(command, CreateRunner):
                self._drop_runner()
                self.runner = ModelRunner(
                    self.model, **command.arguments, draft_model=self.draft_model, vision_tower=self.vision_tower,
                    ranks=self.group,
                )
            elif isinstance(command, AgreeKvTokens):
                self._agree_kv_tokens(command)
            elif isinstance(command, ReportMemory):
                from ninfer.engine.builder import memory_ledger

                self.group.gather(memory_ledger(self.runner, self.model))
            else:
                raise RuntimeError(f"rank {self.group.rank}: unknown command {command!r}")

    def _make_room(self) -> None:
        """Read the oldest launched steps until one more may be launched, as rank 0 reads its own
        before launching past them (the results themselves are rank 0's to use)."""
        while self.runner.readback.num_unread >= MAX_UNREAD_STEPS:
            self._unread.popleft().result()

    def _drop_runner(self) -> None:
        """Release the runner's pools (the probe's, before the final runner or the KV sizing)."""
        self.runner = None
        self._unread.clear()
        self._deferred = None
        gc.collect()
        if self.group.device.type == "cuda":
            torch.cuda.empty_cache()

    def _agree_kv_tokens(self, command: AgreeKvTokens) -> None:
        from ninfer.engine.builder import kv_tokens_in

        self._drop_runner()
        free, _ = torch.cuda.mem_get_info(self.group.device)
        tokens = kv_tokens_in(free, command.reserved_bytes, command.page_bytes, command.page_size, command.max_tokens)
        log.debug("rank %d: KV sizing: %.2f GiB free: %d KV tokens", self.group.rank, free / (1 << 30), tokens)
        self.group.min_over_ranks(tokens)
