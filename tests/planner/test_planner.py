"""The planner (offload_core.planning): budgets, strategy selection at each boundary, partial
residency sized by the budget, the copy/compute event model against hand-computed timelines, the
host tiers, and the plan inputs of real modules and of the real-size meta configs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from offload_core.base.errors import OffloadConfigError
from offload_core.planning import Component, choose_resident, device_bytes, make_plan, simulate
from offload_core.planning.modules import component_from_module
from offload_core.planning.timing import spread
from offload_core.weights.unit import ALIGN_BYTES

pytestmark = pytest.mark.quick

# A pipeline in bytes: a DiT (100 outside its 10 blocks of 50), a text encoder (40 + 4 x 20), a VAE of 30.
# Activation headroom is the estimate: the largest block (50, 20), or all weights without blocks (30).
DIT = Component("transformer", "dit", 100, (50,) * 10)
TE = Component("text_encoder", "text_encoder", 40, (20,) * 4)
VAE = Component("vae", "vae", 30)
PIPE = [TE, DIT, VAE]
GROUPS = [["text_encoder"], ["transformer"], ["vae"]]
ALL_RESIDENT = 750 + 50  # every weight, and the largest activation
MODEL_LEVEL = 600 + 50  # the largest group (the DiT) and its activation
# layerwise, every block streamed: each streamer holds its outside weights and 2 slots of its
# largest block (TE 40 + 40, DiT 100 + 100), and the VAE, staged, runs with its weights and activations
LAYERWISE_FLOOR = 80 + 200 + 60


def plan(budget, **kwargs):
    return make_plan(PIPE, budget, groups=GROUPS, **kwargs)


def test_device_memory_is_bytes_a_size_string_or_a_fraction_of_the_device():
    assert device_bytes(12345) == 12345
    assert device_bytes("16GiB") == 16 * 2**30
    assert device_bytes("12 GB") == 12 * 10**9
    assert device_bytes(0.5, total=80 * 2**30) == 40 * 2**30
    with pytest.raises(OffloadConfigError, match="fraction of the device's memory, which is unknown"):
        device_bytes(0.5)
    with pytest.raises(OffloadConfigError, match="invalid device_memory='16 gigs'"):
        device_bytes("16 gigs")
    with pytest.raises(OffloadConfigError, match="needs a budget"):
        device_bytes(None)


@pytest.mark.parametrize("budget, strategy", [
    (ALL_RESIDENT, "resident"),
    (ALL_RESIDENT - 1, "model"),
    (MODEL_LEVEL, "model"),
    (MODEL_LEVEL - 1, "layerwise"),
    (LAYERWISE_FLOOR, "layerwise"),
])
def test_the_budget_selects_the_coarsest_strategy_that_fits(budget, strategy):
    chosen = plan(budget)
    assert (chosen.strategy, chosen.chosen_by) == (strategy, "budget")
    assert chosen.device_peak <= budget


def test_an_impossible_budget_names_the_smallest_that_works():
    with pytest.raises(OffloadConfigError, match=f"smallest budget that works is {LAYERWISE_FLOOR} B"):
        plan(LAYERWISE_FLOOR - 1)
    with pytest.raises(OffloadConfigError, match=f"below the {MODEL_LEVEL} B model-level offload needs"):
        plan(MODEL_LEVEL - 1, strategy="model")


def test_at_the_layerwise_floor_every_block_streams_and_the_vae_is_staged():
    floor = plan(LAYERWISE_FLOOR)
    assert floor.device_peak == LAYERWISE_FLOOR == floor.min_budget
    dit = floor.component("transformer")
    assert (dit.mode, dit.resident_blocks, dit.streamed_blocks) == ("streamed", (), tuple(range(10)))
    assert (dit.copies_per_forward, dit.bytes_per_forward, dit.slot_bytes) == (10, 500, 100)
    assert floor.component("vae").mode == "staged"
    assert floor.bytes_per_forward == {"text_encoder": 80, "transformer": 500}


def test_each_block_of_budget_keeps_one_more_dit_block_and_copies_fall_in_proportion():
    previous = None
    for k in range(0, 7):  # DiT blocks go first; 340 + 50 k <= 649 up to k = 6
        budget = LAYERWISE_FLOOR + 50 * k
        dit = plan(budget).component("transformer")
        assert len(dit.resident_blocks) == k
        assert dit.bytes_per_forward == 50 * (10 - k)
        assert set(dit.resident_blocks) | set(dit.streamed_blocks) == set(range(10))
        if previous is not None:
            assert plan(budget - 1).component("transformer").resident_blocks == previous
        previous = dit.resident_blocks


def test_a_streamer_whose_blocks_all_fit_drops_its_slot_ring():
    big = plan(10_000, strategy="layerwise")
    assert big.chosen_by == "flag"
    assert [c.mode for c in big.components] == ["resident"] * 3
    assert big.device_peak == 750 + 50


def test_the_slot_ring_is_sized_by_the_largest_streamed_block():
    lopsided = Component("transformer", "dit", 0, (100, 10, 10, 10))  # its activation estimate: 100
    chosen = make_plan([lopsided], 300, strategy="layerwise", resident_blocks=1)
    dit = chosen.component("transformer")
    assert (dit.resident_blocks, dit.slot_bytes, chosen.device_peak) == ((0,), 20, 220)


def test_two_dits_share_the_spare_budget_round_robin():
    wan = [Component("transformer", "dit", 10, (10,) * 8), Component("transformer_2", "dit", 10, (10,) * 8)]
    chosen = make_plan(wan, 10 + 20 + 10 + 20 + 10 + 60, strategy="layerwise")  # both floors, activation, 6 blocks
    assert [len(c.resident_blocks) for c in chosen.components] == [3, 3]


def test_resident_blocks_fixes_the_count_and_must_fit():
    fixed = plan(10_000, strategy="layerwise", resident_blocks=3)
    assert len(fixed.component("transformer").resident_blocks) == 3
    assert len(fixed.component("text_encoder").resident_blocks) == 3
    with pytest.raises(OffloadConfigError, match="resident_blocks=8 needs"):
        plan(500, resident_blocks=8)
    with pytest.raises(OffloadConfigError, match="not to model-level"):
        plan(10_000, strategy="model", resident_blocks=2)
    with pytest.raises(OffloadConfigError, match="invalid resident_blocks"):
        plan(10_000, resident_blocks="many")


def test_a_process_group_makes_the_layerwise_stage_distributed():
    dit = Component("transformer", "dit", 100_000, (50_000,) * 10)  # resident or model-level: 650,000
    distributed = make_plan([dit], 400_000, world_size=2, prefetch_depth=3, resident_blocks=0)
    assert distributed.strategy == "distributed" and distributed.prefetch_depth == 1
    # 2 slots, a staging buffer of one shard (half a block) per slot, the load headers of 10 blocks
    # (and the pass's end) on 2 ranks: 4 rows of 4 int64 sent, 2 rows of 4 gathered from each rank
    assert distributed.component("transformer").slot_bytes == 2 * 50_000 + 2 * 25_000 + 11 * (128 + 64 * 2)
    assert make_plan([dit], 400_000, prefetch_depth=3, resident_blocks=0).component("transformer").slot_bytes == \
        4 * 50_000
    assert plan(MODEL_LEVEL - 1, prefetch_depth=3).component("transformer").slot_bytes == 4 * 50
    assert plan(ALL_RESIDENT, world_size=2).strategy == "resident"


def test_a_given_activation_replaces_the_estimate():
    measured = [c.with_measurements(activation_bytes=0) for c in PIPE]
    assert make_plan(measured, 750, groups=GROUPS).strategy == "resident"
    assert plan(750).strategy == "model"


# -- the copy/compute event model ------------------------------------------------------------------

def test_every_block_streamed_copy_bound_hand_timeline():
    # copy 2, compute 1, 2 slots: copies back to back 0-2, 2-4, 4-6, 6-8; computes 2-3, 4-5, 6-7, 8-9
    forward = simulate([False] * 4, copy_s=2, compute_s=1, depth=1)
    assert (forward.seconds, forward.compute_seconds, forward.copy_seconds) == (9, 4, 8)


def test_only_the_first_copy_shows_when_compute_bound():
    assert simulate([False] * 3, copy_s=1, compute_s=2).seconds == 1 + 3 * 2


def test_a_copy_waits_for_its_slots_previous_occupant():
    # 4 resident blocks first, then 4 streamed, copy 2, compute 1, 2 slots: copies 0-2, 2-4; the third
    # waits for the first streamed block's compute (4-5) so runs 5-7, the fourth 7-9; computes end at 10.
    # Without the wait, copies would run back to back and the forward end at 9.
    assert simulate([True] * 4 + [False] * 4, copy_s=2, compute_s=1).seconds == 10


def test_alternating_resident_blocks_hide_the_copies():
    assert simulate([True, False] * 4, 2, 1).seconds == 9  # the resident block hides the first copy
    assert simulate([False, True] * 4, 2, 1).seconds == 10  # the first copy is exposed


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75])
def test_chosen_spacing_meets_the_ideal_curve_when_copies_take_twice_the_compute(fraction):
    n = 80
    kept = set(choose_resident(n, int(fraction * n), copy_s=2.0, compute_s=1.0, depth=1))
    ratio = simulate([i in kept for i in range(n)], 2.0, 1.0).ratio
    ideal = max(1.0, 2 * (1 - fraction))
    assert ideal <= ratio <= ideal * 1.03


def test_spreading_beats_bunching_the_resident_blocks():
    n, k = 80, 40
    spread_out = set(choose_resident(n, k, 2.0, 1.0))
    bunched = simulate([i < k for i in range(n)], 2.0, 1.0).ratio
    assert simulate([i in spread_out for i in range(n)], 2.0, 1.0).ratio < bunched - 0.4


def test_spread_places_exactly_the_count_asked():
    for n in range(1, 30):
        for k in range(n + 1):
            for phase in (0.0, 0.5, 0.99):
                assert len(spread(n, k, phase)) == k
    assert choose_resident(10, 3) == (0, 4, 7)  # without timings: a resident block leads


def test_a_streamed_plan_predicts_copy_time_and_ratio_from_the_same_model():
    timed = [c.with_measurements(copy_bandwidth=50.0, block_compute_s=0.5) for c in PIPE]  # copy 1 s per DiT block
    dit = make_plan(timed, LAYERWISE_FLOOR + 100, groups=GROUPS).component("transformer")
    assert dit.copy_s_per_forward == pytest.approx(8.0) and dit.compute_s_per_forward == pytest.approx(5.0)
    kept = set(dit.resident_blocks)
    assert dit.ratio == pytest.approx(simulate([i in kept for i in range(10)], 1.0, 0.5).ratio)
    untimed = plan(LAYERWISE_FLOOR).component("transformer")
    assert untimed.copy_s_per_forward is None and untimed.ratio is None
    assert "no predicted ratio" in plan(LAYERWISE_FLOOR).render()


# -- the plan object and host tiers -----------------------------------------------------------------

def test_the_plan_is_json_and_text():
    chosen = plan(LAYERWISE_FLOOR + 100)
    data = json.loads(json.dumps(chosen.to_dict()))
    assert data["strategy"] == "layerwise" and data["device_peak"] == chosen.device_peak
    assert data["components"][1]["resident_blocks"] == list(chosen.component("transformer").resident_blocks)
    text = chosen.render()
    assert "layerwise offload, chosen by the budget" in text
    assert "transformer (dit): 2 of 10 blocks resident" in text


def test_host_budgets_split_the_host_bytes_into_tiers():
    tiered = plan(LAYERWISE_FLOOR, host_memory=600, pinned_memory=200)
    hosts = {c.name: c.host for c in tiered.components}
    assert sum(sum(h.values()) for h in hosts.values()) == 750
    assert sum(h["disk"] for h in hosts.values()) > 0  # 750 bytes do not fit in 600 of RAM
    assert sum(h["pinned"] for h in hosts.values()) <= 200
    untiered = plan(LAYERWISE_FLOOR)
    assert any("no host budget given" in note for note in untiered.notes)
    assert plan(ALL_RESIDENT).component("transformer").host == {}  # no offload, no host copy


# -- plan inputs from modules ---------------------------------------------------------------------

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.blocks[2].shared = self.embed  # a tensor a block shares with the rest stays resident
        self.register_buffer("table", torch.zeros(16))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_modules_blocks_and_bytes(device):
    with torch.device(device):
        model = Stack()
    component = component_from_module("transformer", model, "dit", blocks=["blocks"])
    if device == "meta":  # the tensors' bytes
        block, resident = (8 * 8 + 8) * 4, (4 * 8 + 8) * 4 + 16 * 4
    else:  # as the packer lays them out: each region (weight, bias, ...) starts aligned
        block = -(-8 * 8 * 4 // ALIGN_BYTES) * ALIGN_BYTES + 8 * 4
        resident = 2 * ALIGN_BYTES + 8 * 4  # three regions, each starting aligned: table, embed.weight, embed.bias
    assert component.block_bytes == (block, block, block)
    assert component.resident_bytes == resident


PUBLISHED = {  # parameters, from the model cards
    "real:flux2-dev": {"transformer": 32e9, "text_encoder": 24e9},
    "real:wan2.2-t2v-a14b": {"transformer": 14e9, "transformer_2": 14e9, "text_encoder": 5.7e9},
    "real:qwen-image": {"transformer": 20e9, "text_encoder": 8.3e9},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_size_configs_have_the_published_parameter_counts(name):
    from offload_core.planning.realsize import build_modules

    modules = dict(build_modules(name))
    for component, published in PUBLISHED[name].items():
        params = sum(p.numel() for p in modules[component].parameters())
        assert abs(params / published - 1) < 0.05, (component, params)
        assert {p.dtype for p in modules[component].parameters()} == {torch.bfloat16}
        assert next(modules[component].parameters()).is_meta


def test_the_planner_imports_no_torch():
    import subprocess
    import sys

    probe = "import sys, offload_core.planning; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_growing_budgets_never_exceed_the_budget_and_never_copy_more():
    """FLUX.2-dev at its real size (double blocks larger than single ones), forced layerwise from its
    smallest budget up to everything resident: the peak stays within each budget, and the DiT's
    bytes per forward fall (never rise) to zero."""
    from offload_core.discovery.pipelines import component_kind
    from offload_core.planning.modules import components_from_modules
    from offload_core.planning.realsize import build_modules

    modules = build_modules("real:flux2-dev")
    components = components_from_modules(modules, {name: component_kind(None, name) for name, _ in modules})
    floor = make_plan(components, 2**40, strategy="layerwise", resident_blocks=0).device_peak
    copied = []
    for budget in range(floor, floor + 100 * 2**30, 2**29):
        chosen = make_plan(components, budget, strategy="layerwise")
        assert chosen.device_peak <= budget
        copied.append(chosen.component("transformer").bytes_per_forward)
    assert copied == sorted(copied, reverse=True) and copied[0] > 0 and copied[-1] == 0


def _smallest_printed(message: str) -> str:
    import re

    return re.search(r"(?:smallest budget that works is|is below the|needs) ([\d.]+ [KMGT]?i?B)", message).group(1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strategy", [None, "layerwise", "model"])
def test_the_smallest_budget_printed_works_when_typed_back(seed, strategy):
    """Block sizes that are no round number of KiB or MiB: the printed figure is rounded up, so
    the budget typed back as printed is accepted by the same plan (rounded down, "2.2MiB" was
    refused after the planner had said 2.2 MiB works)."""
    import random

    rng = random.Random(seed)
    scale = rng.choice((2**10, 2**20, 2**30))
    dit = Component("transformer", "dit", rng.randrange(scale, 9 * scale),
                    tuple(rng.randrange(scale, 3 * scale) for _ in range(8)))
    te = Component("text_encoder", "text_encoder", rng.randrange(scale), (rng.randrange(scale, 2 * scale),) * 3)
    components = [te, dit, Component("vae", "vae", rng.randrange(scale))]
    with pytest.raises(OffloadConfigError) as refused:
        make_plan(components, 1, strategy=strategy)
    printed = _smallest_printed(str(refused.value))
    accepted = make_plan(components, printed, strategy=strategy)
    assert accepted.min_budget <= accepted.budget
    assert f"the smallest budget that works: {printed}" in accepted.render()
    exact = device_bytes(printed)
    assert exact - accepted.min_budget < scale // 10, "rounded up by less than the last printed digit"
