"""RouteProbe: whether a library's product computes what our reference does on this device.

Some fast routes lean on library ops that a torch build or a device may lack, or lay out
differently than documented (cuBLAS's blockwise FP8 product, torch's scaled grouped GEMM). A
route is taken only after a small problem through it matches the reference, decided once per
device and variant; never inside a graph capture (the check reads a result back), where an
undecided variant keeps the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger("ninfer.kernels")


class RouteProbe:
    def __init__(self, route: str, fallback: str, tolerance: float):
        """route, fallback: what the log calls them; tolerance: the largest error allowed,
        relative to the largest reference output."""
        self.route = route
        self.fallback = fallback
        self.tolerance = tolerance
        self.known: dict[tuple[int, Hashable], bool] = {}

    def supported(
        self, device: torch.device, variant: Hashable, problem: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> bool:
        """problem() -> (the route's output, the reference's) of a small problem on `device`."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        known = self.known.get((index, variant))
        if known is not None:
            return known
        if torch.cuda.is_current_stream_capturing():
            return False
        self.known[(index, variant)] = ok = self._check(problem)
        return ok

    def _check(self, problem: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> bool:
        try:
            got, expected = problem()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            log.info("%s: %s is missing here (%s)", self.fallback, self.route, error)
            return False
        error = ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6)).item()
        if error > self.tolerance:
            log.warning("%s: %s is off by %.3g of the largest output", self.fallback, self.route, error)
            return False
        return True
