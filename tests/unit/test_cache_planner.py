"""The cache planner: recovery costs, drop order, spill-or-drop, and where its rates come from."""

from __future__ import annotations

import json

import pytest

from ninfer.context_cost_presets import ContextCostError, read_presets
from ninfer.contract.reuse_path import ReusePath
from ninfer.engine.cache.context_cache import CacheLimits, ContextCache
from ninfer.engine.cache.context_costs import ContextCosts, resolve_context_costs
from ninfer.engine.cache.planner import SUPERSEDED_WEIGHT, CachePlanner
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.placement import Placement
from ninfer.engine.scheduler.step import SpillSlot
from ninfer.engine.state_pool import StatePool
from ninfer.models.config import ModelConfig

COSTS = ContextCosts(prefill_seconds_per_token=1e-3, host_transfer_bytes_per_second=1e9, source="test")
STATE_BYTES = 10_000_000  # 10 ms to restore at 1 GB/s: worth it for more than 10 recomputed tokens


def make(device_slots: int, host_slots: int, limits: CacheLimits | None = None):
    kv = KVPool(256, 4)
    cache = ContextCache(kv, StatePool(device_slots), exact_frontier_only=True, host_pool=StatePool(host_slots),
                         limits=limits or CacheLimits())
    planner = CachePlanner(cache, COSTS, STATE_BYTES)
    actions = ActionQueue()
    return cache, planner, Placement(cache, planner, actions), actions


def add(cache: ContextCache, tokens: list[int], path=ReusePath.PRIVATE_ENDPOINT, continuation: str = ""):
    pages = cache.kv_pool.allocate(cache.kv_pool.pages_for(len(tokens)))
    return cache.insert(tokens, pages, cache.state_pool.allocate(), path, None, continuation)


CONVERSATION = list(range(100, 200))


def test_losses_count_only_what_a_shorter_checkpoint_does_not_cover():
    cache, planner, _, _ = make(device_slots=4, host_slots=0)
    closure = add(cache, CONVERSATION[:60], ReusePath.PRIVATE_TURN_CLOSURE)
    prompt_end = add(cache, CONVERSATION[:66])  # six tokens past the turn closure
    other = add(cache, list(range(500, 540)))  # another conversation: nothing covers it
    loss = planner.loss_seconds()
    # The closure is extended by the newer prompt-end checkpoint: superseded.
    assert loss[closure.checkpoint_id] == pytest.approx(SUPERSEDED_WEIGHT * 60e-3)
    assert loss[prompt_end.checkpoint_id] == pytest.approx(6e-3)
    assert loss[other.checkpoint_id] == pytest.approx(40e-3)
    order = planner.drop_order()
    assert order[0] is closure and order[-1] is other
    assert planner.drop_order(keep=closure)[0] is prompt_end
    cache.touch(closure)  # used again, newer than its extension: no longer superseded
    assert planner.loss_seconds()[closure.checkpoint_id] == pytest.approx(60e-3)
    cache.remove(prompt_end)
    assert prompt_end.checkpoint_id not in planner.loss_seconds()
    cache.clear()


def test_spill_only_what_is_worth_restoring():
    cache, planner, placement, actions = make(device_slots=2, host_slots=2)
    long_one = add(cache, list(range(300, 380)))  # 80 ms to recompute: worth a 10 ms restore
    near = add(cache, CONVERSATION[:4])  # 4 ms to recompute: cheaper than restoring
    assert planner.worth_spilling(long_one) and not planner.worth_spilling(near)
    assert placement.free_device_slot()  # the cheapest leaves: dropped, not spilled
    assert near.checkpoint_id not in cache.checkpoints and placement.num_drops == 1 and not actions
    assert placement.free_device_slot()  # then the long one: spilled to the host
    assert long_one.on_host and list(actions) == [SpillSlot(device_slot=0, host_slot=0)]
    assert cache.state_pool.num_free == 2 and cache.host_pool.num_free == 1
    assert not placement.free_device_slot()  # nothing left on the device
    cache.clear()
    assert cache.host_pool.num_free == 2 and cache.kv_pool.num_free == cache.kv_pool.num_pages


def test_a_full_host_tier_keeps_the_more_valuable_checkpoint():
    cache, planner, placement, _ = make(device_slots=1, host_slots=1)
    valuable = add(cache, list(range(300, 400)))
    assert placement.free_device_slot() and valuable.on_host
    cheap = add(cache, list(range(600, 630)))  # 30 ms of recompute, less than what is on the host
    assert placement.free_device_slot()
    assert cheap.checkpoint_id not in cache.checkpoints and valuable.on_host
    more = add(cache, list(range(700, 900)))  # worth more than the host's: it takes the host slot
    assert placement.free_device_slot()
    assert more.on_host and valuable.checkpoint_id not in cache.checkpoints
    cache.clear()


def capture(cache: ContextCache, planner: CachePlanner, conversation: str, tokens: list[int],
            path=ReusePath.PRIVATE_ENDPOINT):
    """What a request's capture does (scheduler/checkpoints.py): kept if the planner admits it,
    then whatever the planner names for the limits is dropped."""
    if not planner.admits(path, conversation, tokens):
        return None
    ck = add(cache, tokens, path, conversation)
    for victim, _ in planner.over_bounds(ck):
        assert victim is not ck
        cache.remove(victim)
    return ck


def conversations(cache: ContextCache) -> set[str]:
    return {ck.continuation for ck in cache.checkpoints.values() if not ck.shared}


def test_descriptor_limits_are_bounds_on_the_planners_drop_order():
    limits = CacheLimits(max_private_continuations=2, max_shared_prefixes=1)
    cache, planner, _, _ = make(device_slots=16, host_slots=0, limits=limits)
    # Two conversations the forecast has no record of are as far off as each other: of them, the
    # one costing least to lose gives way (b, 20 ms of recompute), not the least recently used (a).
    long_a, short_b = list(range(1000, 1090)), list(range(2000, 2020))
    assert capture(cache, planner, "a", long_a) and capture(cache, planner, "b", short_b)
    cache.note_admission("c", list(range(3000, 3050)))
    assert capture(cache, planner, "c", list(range(3000, 3050))) is not None
    assert conversations(cache) == {"a", "c"}
    cache.clear()
    # Three conversations taking turns at a limit of two: the one due last gives way. From the
    # second round on that is the conversation being captured, so its captures are declined and
    # nothing is dropped for them; least recently used would drop the one due next every turn.
    histories = {name: [ord(name)] * 40 for name in "xyz"}
    kept: list[list[bool]] = []
    for round_index in range(4):
        kept.append([])
        for name in "xyz":
            histories[name] = histories[name] + [round_index] * 10
            cache.note_admission(name, histories[name])
            kept[-1].append(capture(cache, planner, name, histories[name]) is not None)
            assert len(conversations(cache)) <= 2
    assert kept == [[True, True, True]] + [[False, True, True]] * 3
    # Pressure takes the same order: y is due at the next admission, z after it.
    assert planner.drop_order()[0].continuation == "z"
    # Shared prefixes: a new one is kept, and the others give way in drop order (never the new one).
    first = capture(cache, planner, "y", list(range(5000, 5030)), ReusePath.SHARED_STABLE_PREFIX)
    second = capture(cache, planner, "z", list(range(6000, 6010)), ReusePath.SHARED_STABLE_PREFIX)
    assert first.checkpoint_id not in cache.checkpoints and second.checkpoint_id in cache.checkpoints
    cache.clear()
    # A limit of zero keeps none of that kind.
    cache0, planner0, _, _ = make(device_slots=2, host_slots=0, limits=CacheLimits(0, 0, 0))
    for path in (ReusePath.PRIVATE_ENDPOINT, ReusePath.SHARED_STABLE_PREFIX, ReusePath.PRIVATE_LONG_ANCHOR):
        assert not planner0.admits(path, "a", long_a)


def test_rates_resolve_from_generic_compiled_and_a_presets_file(tmp_path):
    tiny = ModelConfig(model_type="llama", family="llama", vocab_size=10, hidden_size=8, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=8, intermediate_size=8)
    assert "generic cpu" in resolve_context_costs(tiny, "cpu").source
    big = ModelConfig(model_type="qwen3_5_text", family="qwen3_5", vocab_size=10, hidden_size=5120,
                      num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                      intermediate_size=17408)
    compiled = resolve_context_costs(big, "cuda")
    assert compiled.source.startswith("compiled defaults") and compiled.prefill_seconds_per_token == 1 / 8200
    presets = tmp_path / "costs.json"
    presets.write_text(json.dumps({"prefill_seconds_per_token": 2e-4}))
    chosen = resolve_context_costs(big, "cuda", str(presets))
    assert chosen.prefill_seconds_per_token == 2e-4 and chosen.host_transfer_bytes_per_second == 25e9
    assert str(presets) in chosen.source


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prefill_seconds_per_tokn": 1e-4}', "unknown key 'prefill_seconds_per_tokn'"),
        ('{"host_transfer_bytes_per_second": -5}', "must be a positive number"),
        ('{"prefill_seconds_per_token": true}', "must be a positive number"),
    ],
)
def test_a_malformed_presets_file_names_its_problem(tmp_path, content, problem):
    presets = tmp_path / "costs.json"
    presets.write_text(content)
    with pytest.raises(ContextCostError, match=problem) as error:
        read_presets(str(presets))
    assert str(presets) in str(error.value)
    with pytest.raises(ContextCostError, match="cannot read"):
        read_presets(str(tmp_path / "missing.json"))
