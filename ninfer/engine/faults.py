"""Injected faults for the reliability tests: NINFER_TEST_FAULTS="KIND@N[,KIND@N...]".

Read once when the engine is built, and only when the variable is set: a normal run has no
hook at all. N counts the runner's step launches (1-based); KIND is
  error  the launch raises RuntimeError (a failed step)
  oom    the launch raises torch.OutOfMemoryError (a step out of device memory)
  die    the engine process exits at once (os._exit), as if killed
so the tests can check that the affected requests end with a clear error, the others finish,
/health follows and the server recovers.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("ninfer.engine")

ENV = "NINFER_TEST_FAULTS"
KINDS = ("error", "oom", "die")


def parse_faults(text: str) -> dict[int, str]:
    """"error@3,die@9" -> {3: "error", 9: "die"}; raises ValueError naming the bad item."""
    plan: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, at = item.partition("@")
        if kind not in KINDS or not at.isdigit() or int(at) < 1:
            raise ValueError(f"{ENV}: {item!r} is not KIND@N with KIND in {', '.join(KINDS)} and N >= 1")
        plan[int(at)] = kind
    return plan


def install_faults(runner) -> None:
    """Wrap runner.launch with the plan from the environment; does nothing when it is unset."""
    text = os.environ.get(ENV)
    if not text:
        return
    plan = parse_faults(text)
    launch = runner.launch
    launches = {"count": 0}

    def launch_with_faults(step):
        launches["count"] += 1
        kind = plan.get(launches["count"])
        if kind == "error":
            raise RuntimeError(f"injected fault at launch {launches['count']}")
        if kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory at launch {launches['count']}")
        if kind == "die":
            os._exit(70)
        return launch(step)

    runner.launch = launch_with_faults
    log.warning("%s=%s: injected faults are active (tests only)", ENV, text)
