"""Issue 29, items 1 to 5 (docs/design.md, contract rows 5, 11, 20 and 21): what autograd and
train mode refuse or keep without offload, they refuse or keep with it, under layerwise and
model-level offload, checked against the same model without offload."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import offload_core

from helpers import chaos_backend

ENABLE_VARIANTS = {
    "layerwise": {"enable_layerwise_offload": True},
    "layerwise2": {"enable_layerwise_offload": True, "prefetch_depth": 2},
    "model": {"enable_cpu_offload": True},
}
D = 8


class Block(nn.Module):
    def __init__(self, mode: str = "") -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)
        self.mode = mode
        self.bn = nn.BatchNorm1d(D) if mode == "bn" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "stepped":  # a detached saved use of l1's weight, read after its grad is in
            return self.l1(torch.tanh(F.linear(x, self.l1.weight.detach())))
        if self.mode == "keeps":
            if not hasattr(self, "_wt"):
                self._wt = self.l1.weight.t()
            return self.l2(torch.sigmoid(x @ self._wt))
        y = torch.sigmoid(self.l1(x))
        if self.mode == "inplace":
            y.mul_(2)  # y was saved by sigmoid's backward
        if self.bn is not None:
            y = self.bn(y)
        return self.l2(y)


class Model(nn.Module):
    def __init__(self, mode: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(mode) for _ in range(3)])
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def pair(mode: str = ""):
    model = Model(mode)
    return model, copy.deepcopy(model), torch.randn(4, D, generator=torch.Generator().manual_seed(1))


def enable(model, strategy):
    return offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_VARIANTS[strategy])


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_an_in_place_edit_of_a_saved_activation_is_refused_as_without_offload(strategy, trainable):
    model, reference, x = pair("inplace")
    for m in (model, reference):
        m.requires_grad_(trainable)
    handle = enable(model, strategy)
    for m in (reference, model):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            m(x.clone().requires_grad_(True)).sum().backward()
    handle.disable()


@pytest.mark.parametrize("change", ["mul_", "optimizer", "load_state_dict"])
@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_a_backward_after_the_weights_changed_is_refused(strategy, change):
    model, reference, x = pair()
    handle = enable(model, strategy)
    state = {k: v + 1 for k, v in reference.state_dict().items()}
    for m in (reference, model):
        loss = m(x).square().sum()
        with torch.no_grad():
            if change == "mul_":
                m.blocks[1].l2.weight.mul_(2)
            elif change == "optimizer":
                m.blocks[1].l2.weight.grad = torch.ones_like(m.blocks[1].l2.weight)
                torch.optim.SGD(m.parameters(), lr=0.1).step()
            else:
                m.load_state_dict(state)
        with pytest.raises(RuntimeError, match="modified"):
            loss.backward()
    handle.disable()
    for m in (model, reference):  # usable afterwards, and the same
        m.zero_grad()
        m(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_a_weight_stepped_inside_backward_before_a_later_saved_use_is_refused(strategy):
    model, reference, x = pair("stepped")

    def step(p):
        with torch.no_grad():
            p.add_(1.0)

    for m in (model, reference):
        m.blocks[1].l1.weight.register_post_accumulate_grad_hook(step)
    handle = enable(model, strategy)
    for m in (reference, model):
        with pytest.raises(RuntimeError, match="modified"):
            m(x).sum().backward()
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_an_optimizer_stepping_each_weight_in_backward_is_exact_and_race_free(strategy):
    """An optimizer in backward (``register_post_accumulate_grad_hook``) steps a block's home
    while its backward runs; under the chaos backend's race sanitizer, a copy for that backward
    still reading the home is a reported race, and the weights must equal the model's without
    offload after every step."""
    model, reference, x = pair()
    for m in (model, reference):
        optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in m.parameters()}

        def step(p, optimizers=optimizers):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(step)
    handle = enable(model, strategy)
    for k in range(4):
        for m in (model, reference):
            m(x + k).square().sum().backward()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(a, b), f"step {k}: {name}"
    handle.disable()
    assert torch.equal(model(x), reference(x))


def _transpose(m) -> None:
    """Block 1's weight given its own memory in another layout (square: the same shape)."""
    w = m.blocks[1].l1.weight
    w.data = w.data.t()


def _train_across_a_new_layout(model, reference, x) -> None:
    """A step, block 1's weight given another layout, a step: the same gradients and layouts."""
    for m in (model, reference):
        m(x).square().sum().backward()
        _transpose(m)
        m(x).square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name
        assert a.stride() == b.stride(), name


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_a_weight_given_another_layout_between_steps_trains_exactly(strategy):
    """Layerwise finds the new layout as the block binds (a pass starts with the buffers' check
    alone) and runs that call on a device copy of it: the gradients, and the refusal of a weight
    changed in place before backward, are those of the model without offload."""
    model, reference, x = pair()
    handle = enable(model, strategy)
    _train_across_a_new_layout(model, reference, x)
    for m in (reference, model):
        _transpose(m)
        loss = m(x).square().sum()
        with torch.no_grad():
            m.blocks[1].l1.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified"):
            loss.backward()
    handle.disable()
    for m in (model, reference):
        m.zero_grad()
        m(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


class Checkpointed(Model):
    """Each block under non-reentrant gradient checkpointing: backward runs its forward again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_a_weight_given_another_layout_trains_exactly_under_checkpointing(strategy):
    """Layerwise re-packs a block given another layout before the call after the one that ran it
    on a device copy; the recompute inside that call's backward must not re-pack (the backward
    still reads the slots as the forward laid them out): a block run again inside a backward is
    checked as in a pass."""
    model, x = Checkpointed(), torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    handle = enable(model, strategy)
    _train_across_a_new_layout(model, reference, x)
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_train_mode_batchnorm_running_statistics_come_home(strategy):
    model, reference, x = pair("bn")
    handle = enable(model, strategy)
    with torch.no_grad():
        for step in range(3):
            assert torch.equal(model(x + step), reference(x + step))
    for m in (model, reference):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    handle.disable()
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_pre_hook_editing_a_preloaded_block_in_place_is_seen_inside_frozen(depth):
    model, reference, x = pair()

    def edit(module, args):
        with torch.no_grad():
            module.blocks[0].l1.weight.mul_(1.5)
            module.blocks[1].l2.weight.add_(0.1)

    for m in (model, reference):
        m.register_forward_pre_hook(edit)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True,
                                         prefetch_depth=depth)
    with torch.no_grad(), handle.frozen():
        for _ in range(4):
            assert torch.equal(model(x), reference(x))
    handle.disable()
    assert torch.equal(model(x), reference(x))


def test_a_pipeline_dit_pre_hook_editing_its_first_block_is_exact():
    """Every pipeline call without step callbacks runs inside ``frozen()``: the DiT's first blocks
    are loaded as its previous forward ends, before its pre-hook edits them."""
    from offload_core.tiny import build_pipeline

    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")

    def edit(module, args, kwargs):
        with torch.no_grad():
            module.transformer_blocks[0].attn.to_q.weight.mul_(1.5)
            module.single_transformer_blocks[0].attn.to_out.weight.mul_(1.5)

    for tiny in (ours, theirs):
        tiny.pipe.transformer.register_forward_pre_hook(edit, with_kwargs=True)
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), enable_layerwise_offload=True)
    for seed in (0, 1):
        assert torch.equal(ours.run(seed=seed), theirs.run(seed=seed))
    handle.disable()
    assert torch.equal(ours.run(seed=2), theirs.run(seed=2))


@pytest.mark.parametrize("strategy", ["layerwise", "model"])
def test_a_module_keeping_a_view_of_its_weight_is_named_in_a_warning(strategy, caplog):
    model, _, x = pair("keeps")
    handle = enable(model, strategy)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        for _ in range(2):
            model(x)
    handle.disable()
    assert "attribute _wt of module blocks.0" in caplog.text
