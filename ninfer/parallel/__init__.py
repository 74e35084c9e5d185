"""Tensor parallelism (--tensor-parallel N): one engine process per rank over torch.distributed.

Rank 0 is the engine process the API process spawned: it schedules and sends each runner call
(the step plan) to the follower ranks, which make the same call on their shard of the weights.
"""
