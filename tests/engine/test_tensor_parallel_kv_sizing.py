"""--kv-capacity auto with tensor-parallel followers: every rank sizes its pool from its own free
memory less what the probe measured, and the smallest answer wins (rank 0 and a follower's code,
on a 'cuda' configuration stubbed on the CPU; the ranks' collective is a stand-in)."""

from __future__ import annotations

import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.engine import builder
from ninfer.models.loader import build_model
from ninfer.parallel.commands import AgreeKvTokens
from ninfer.parallel.follower import Follower
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_kv_sizing_record import GIB, stub_device  # noqa: F401 - the fixture

FOLLOWER_DEVICE = torch.device("cuda:1")


class Ranks:
    """Rank 0's followers and their group, with one follower whose answer the minimum takes."""

    def __init__(self):
        self.answers: list[int] = []
        self.commands: list[object] = []
        self.group = self
        self.device = FOLLOWER_DEVICE
        self.rank = 1
        self.follower = Follower(self, model=None)

    def send(self, command: object) -> None:
        self.commands.append(command)
        self.follower._agree_kv_tokens(command)  # the follower's answer lands in self.answers

    def min_over_ranks(self, value: int) -> int:
        self.answers.append(value)
        return min(self.answers)


def test_the_smallest_rank_sizes_every_pool(stub_device, monkeypatch, tmp_path):
    # Rank 0 has 40 GiB free (stub_device), the follower 30.
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (30 * GIB if device == FOLLOWER_DEVICE else 40 * GIB, 80 * GIB))  # fmt: skip
    model = build_model(open_artifact(make_tiny_qwen3_5(tmp_path / "model")).config, torch.float32, "cpu")
    engine = EngineConfig(device="cuda:0", max_context=1 << 30, max_concurrency=2, log_stats_interval_ms=0)
    alone, _ = builder._auto_kv_tokens(model, None, engine)
    ranks = Ranks()
    tokens, _ = builder._auto_kv_tokens(model, None, engine, followers=ranks)
    (command,) = ranks.commands
    assert isinstance(command, AgreeKvTokens)
    follower_tokens, rank0_tokens = ranks.answers
    assert rank0_tokens == alone and tokens == follower_tokens < alone
    page_bytes = builder.kv_page_bytes(model, engine.page_size)
    assert (alone - follower_tokens) // engine.page_size == 10 * GIB // page_bytes  # 10 GiB less free
