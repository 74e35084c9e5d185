"""LeaderRunner: rank 0's ModelRunner, which hands each call to the follower ranks before making it.

The scheduler's plan reaches the runner through these calls only (launch, sample_deferred), so
the followers, making the same calls with the same arguments on their shards, keep their KV
pages and state slots in step with rank 0's and meet it at every collective of the step.
"""

from __future__ import annotations

import numpy as np

from ninfer.engine.deferred_sampling import DeferredSampling
from ninfer.engine.pending_step import PendingStep
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import SchedulerStep
from ninfer.models.causal_lm import CausalLM
from ninfer.parallel.commands import CreateRunner, Launch, SampleDeferred
from ninfer.parallel.followers import Followers


class LeaderRunner(ModelRunner):
    def __init__(self, followers: Followers, model: CausalLM, *, draft_model=None, vision_tower=None, **arguments):
        """arguments: ModelRunner's, plain values only (they are sent to the followers). draft_model
        (a DFlash / DFlash2 drafter) and vision_tower run whole on every rank: each follower loads
        its own copy and encodes the media its step plan carries, as this rank does."""
        # The followers build theirs at the same time: capturing graphs runs the model's collectives.
        followers.send(CreateRunner(arguments))
        super().__init__(model, **arguments, draft_model=draft_model, vision_tower=vision_tower, ranks=followers.group)
        self.followers = followers

    def launch(self, step: SchedulerStep) -> PendingStep | DeferredSampling:
        self.followers.send(Launch(step))
        return super().launch(step)

    def sample_deferred(self, deferred: DeferredSampling, masks: dict[int, np.ndarray | None]) -> PendingStep:
        self.followers.send(SampleDeferred(masks))
        return super().sample_deferred(deferred, masks)
