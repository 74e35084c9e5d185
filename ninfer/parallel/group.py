"""RankGroup: the collectives the tensor-parallel ranks of one engine share (torch.distributed).

Two groups over the same ranks: the device group (NCCL on CUDA, gloo on the CPU) carries the
model's all-reduces and the sampled ids, as plain collectives on tensors so that CUDA graphs can
capture them; the command group (always gloo, on the host) carries rank 0's step plans to the
followers, which wait in it between steps however long the server idles.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# Joining, and any one collective of the device group (a step's all-reduce), may take this long.
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
# Followers wait for the next command as long as the server stays up: no timeout in practice. A
# rank that dies is noticed by its peers' sockets closing, not by a timeout.
COMMAND_TIMEOUT = datetime.timedelta(days=365)


class RankGroup:
    def __init__(self, rank: int, size: int, device: torch.device, commands: dist.ProcessGroup):
        self.rank = rank
        self.size = size
        self.device = device
        self._commands = commands

    @classmethod
    def join(cls, rank: int, size: int, rendezvous_file: str, device: str) -> RankGroup:
        """Join the ranks' process groups (blocks until every rank has joined); one group per
        process, since torch.distributed keeps the default group process-wide."""
        target = torch.device(device)
        if target.type == "cuda":
            torch.cuda.set_device(target)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{rendezvous_file}",
            rank=rank,
            world_size=size,
            timeout=JOIN_TIMEOUT,
            device_id=target if target.type == "cuda" else None,
        )
        commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        return cls(rank, size, target, commands)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- device collectives (capture-safe: plain collectives on device tensors) ----------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (a row-parallel layer's partial products)."""
        dist.all_reduce(tensor)
        return tensor

    def broadcast_from_leader(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite `tensor` with rank 0's, in place."""
        dist.broadcast(tensor, src=0)
        return tensor

    # ---- host collectives (the command group) ----------------------------------------------------
    def send(self, command: object) -> None:
        """Rank 0: hand `command` to every follower (each is waiting in receive())."""
        dist.broadcast_object_list([command], src=0, group=self._commands)

    def receive(self) -> object:
        """A follower: the next command rank 0 sends."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self._commands)
        return box[0]

    def gather(self, value: object) -> list[object]:
        """Every rank's `value`, by rank, on every rank."""
        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self._commands)
        return values

    def min_over_ranks(self, value: int) -> int:
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._commands)
        return int(box.item())

    def close(self) -> None:
        """Leave the process groups (a later engine of this process joins afresh)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def picklable_error(error: BaseException) -> BaseException:
    """`error` if it crosses to another rank intact (gather pickles it), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send its text
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
