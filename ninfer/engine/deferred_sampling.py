"""DeferredSampling: a launched step whose rows are computed but not yet sampled.

A decode round launched ahead (decode overlap) for a request with an output constraint cannot
be masked at launch: the mask follows the token the round before it samples, still unread. The
runner enqueues the round's forward and hands this back; once the engine has committed the
previous round's tokens, the scheduler gives the masks and the runner samples
(ModelRunner.sample_deferred), behind the forward in the same stream: the device never waits
for the host's grammar work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.engine.scheduler import SchedulerStep


@dataclass(frozen=True)
class DeferredSampling:
    step: SchedulerStep
    on_graphs: bool  # the forward replayed the decode graphs (their logits buffer holds the rows)
