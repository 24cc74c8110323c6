"""Autograd through offloaded models (docs/layerwise.md, "Training and gradients"): gradients
equal to the same model without offload, bit for bit, for layerwise (depth 1 and 2) and
model-level offload of real diffusers DiTs, in chaos mode under the race sanitizer; every block
copied once in forward and once in backward, no miss, device memory bounded to the slots."""

from __future__ import annotations

import copy

import pytest
import torch

import offload_core

from denoisers import build_transformer
from grads import assert_equal, fine_tune_alike, input_grads, leaf_inputs, loss_of, param_grads
from helpers import chaos_backend, exact_accounting, first_tensor

MODELS = ["flux2", "qwen-image", "wan-t2v", "sd3"]
ENABLE_VARIANTS = {
    "layerwise1": {"enable_layerwise_offload": True, "prefetch_depth": 1},
    "layerwise2": {"enable_layerwise_offload": True, "prefetch_depth": 2},
    "model": {"enable_cpu_offload": True},
}


def pair(name: str, trainable: bool):
    """The model to offload, an untouched copy of it, and their inputs."""
    model, inputs = build_transformer(name)
    model.requires_grad_(trainable)
    return model, copy.deepcopy(model), inputs


def enable(model, strategy: str):
    return offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_VARIANTS[strategy])


def assert_streamed_twice(handle, steps: int) -> None:
    """Layerwise: each block was loaded once per forward and once per backward (less the last
    blocks, still in their slots when the backward starts), none late, and the device never held
    more than the resident weights and the slots."""
    part = handle.describe()[0]
    stats = handle.stats()
    assert stats["prefetch_misses"] == 0
    blocks = len(part["streamed_blocks"])
    assert stats["loads"] == steps * (2 * blocks - min(part["slots"], blocks))
    assert stats["retired_slot_bytes"] == 0
    if exact_accounting():
        assert stats["device_peak_bytes"] == part["device_weight_bytes"]


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
@pytest.mark.parametrize("name", MODELS)
def test_input_gradients_through_a_frozen_model(name, strategy):
    model, reference, inputs = pair(name, trainable=False)
    theirs = leaf_inputs(inputs)
    loss_of(reference, theirs).backward()
    handle = enable(model, strategy)
    ours = leaf_inputs(inputs)
    loss_of(model, ours).backward()
    assert_equal(input_grads(ours), input_grads(theirs), "input gradients")
    if handle.strategy == "layerwise":
        assert_streamed_twice(handle, steps=1)
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
@pytest.mark.parametrize("name", ["flux2", "wan-t2v"])
def test_weight_gradients_and_optimizer_steps_update_the_host_truth(name, strategy):
    """Full fine-tuning: every weight trainable, three SGD-with-momentum steps; gradients and the
    weights after each step equal those without offload."""
    model, reference, inputs = pair(name, trainable=True)
    handle = enable(model, strategy)
    fine_tune_alike(model, reference, inputs, steps=3)
    if handle.strategy == "layerwise":
        assert_streamed_twice(handle, steps=3)
    handle.disable()
    assert_equal(dict(model.state_dict()), dict(reference.state_dict()), "weights after disable")


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_autograd_grad_retain_graph_and_two_backward_passes(strategy):
    model, reference, inputs = pair("qwen-image", trainable=True)
    handle = enable(model, strategy)
    results = []
    for m in (reference, model):
        x = leaf_inputs(inputs)
        loss = loss_of(m, x)
        weight = next(p for n, p in m.named_parameters() if "transformer_blocks.0." in n)
        first = torch.autograd.grad(loss, [x["hidden_states"], weight], retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()  # the graph's saved weights are read a third time
        results.append((first, input_grads(x), param_grads(m)))
    (first_ref, inputs_ref, params_ref), (first_ours, inputs_ours, params_ours) = results
    assert all(torch.equal(a, b) for a, b in zip(first_ours, first_ref)), "autograd.grad differs"
    assert_equal(inputs_ours, inputs_ref, "input gradients after two backward passes")
    assert_equal(params_ours, params_ref, "accumulated weight gradients")
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_gradient_checkpointing(strategy):
    model, reference, inputs = pair("flux2", trainable=True)
    for m in (model, reference):
        m.enable_gradient_checkpointing()
        m.train()
    handle = enable(model, strategy)
    expected, got = leaf_inputs(inputs), leaf_inputs(inputs)
    loss_of(reference, expected).backward()
    loss_of(model, got).backward()
    assert_equal(input_grads(got), input_grads(expected), "input gradients")
    assert_equal(param_grads(model), param_grads(reference), "weight gradients")
    assert handle.stats()["retired_slot_bytes"] == 0
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
def test_mixed_precision(strategy):
    model, reference, inputs = pair("wan-t2v", trainable=True)
    handle = enable(model, strategy)
    device_type = handle.backend.device().type
    for m in (reference, model):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = loss_of(m, inputs)
        loss.backward()
    assert_equal(param_grads(model), param_grads(reference), "weight gradients under autocast")
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_VARIANTS)
@pytest.mark.parametrize("name", ["flux2", "qwen-image", "wan-t2v"])
def test_lora_training_loop_matches_bit_for_bit(name, strategy):
    """Five AdamW steps on a peft LoRA over a frozen base: the adapter weights after every step
    equal those of the same loop without offload; the adapter weights stream with their blocks."""
    peft = pytest.importorskip("peft")
    model, reference, inputs = pair(name, trainable=False)
    config = peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v"])
    for m in (model, reference):
        torch.manual_seed(0)
        m.add_adapter(config)
    handle = enable(model, strategy)
    loops = []
    for m in (model, reference):
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        loops.append((m, params, torch.optim.AdamW(params.values(), lr=1e-2)))
    assert loops[0][1] and all("lora_" in n for n in loops[0][1])
    for step in range(5):
        for m, params, opt in loops:
            opt.zero_grad()
            loss_of(m, inputs).backward()
            opt.step()
        ours, theirs = ({n: p.detach().clone() for n, p in params.items()} for _, params, _ in loops)
        assert_equal(ours, theirs, f"LoRA weights after step {step}")
    if handle.strategy == "layerwise":
        assert_streamed_twice(handle, steps=5)
    handle.disable()


# -- slot memory that escapes its block --------------------------------------------------------
class Returning(torch.nn.Module):
    """A block that also returns a view of one of its weights, read by its parent later."""

    def __init__(self, block) -> None:
        super().__init__()
        self.inner = block

    def forward(self, x: torch.Tensor):
        return self.inner(x), self.inner.layers[0].weight[0]


class Viewing(torch.nn.Module):
    """A stack whose blocks each also return a view of one of their weights; the parent reads
    all the views after every block has run (by then each slot was refilled)."""

    def __init__(self, stack) -> None:
        super().__init__()
        self.embed, self.head = stack.embed, stack.head
        self.blocks = torch.nn.ModuleList(Returning(b) for b in stack.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        views = []
        for block in self.blocks:
            x, view = block(x)
            views.append(view)
        return self.head(x) + torch.stack(views).sum(0)


def stack(blocks: int = 5):
    from stacks import StackSpec, build_stack

    return build_stack(StackSpec(layer_dtypes=[[torch.float32, torch.float32]] * blocks))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_kept_detach_reads_its_own_block(depth, caplog):
    """A forward hook keeps ``weight.detach()`` of every block: each kept tensor still holds its
    block's weights after the later blocks ran (its slot memory went to it, the slot got new
    memory, and the stats say so), and the outputs stay exact."""
    model = stack()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    expected_weights = [b.layers[1].weight.detach().clone() for b in model.blocks]
    with torch.no_grad():
        expected = model(x)
    kept = []
    hooks = [b.layers[1].register_forward_hook(lambda m, a, o: kept.append(m.weight.detach())) for b in model.blocks]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=chaos_backend())
    with torch.no_grad(), caplog.at_level("WARNING", logger="offload_core"):
        for _ in range(2):
            kept.clear()
            assert torch.equal(model(x), expected)
    assert all(torch.equal(k, w) for k, w in zip(kept, expected_weights)), "a kept weight shows another block"
    assert "still referenced outside its block" in caplog.text
    part = handle.describe()[0]
    # every slot refilled in a pass held a kept weight: one new slot each, and no other
    refilled = len(part["streamed_blocks"]) - part["slots"]
    assert handle.stats()["retired_slot_bytes"] == 2 * refilled * part["slot_bytes"]
    for h in hooks:
        h.remove()
    handle.disable()


class Scratching(torch.nn.Module):
    """Between its blocks, the parent computes on device memory and drops it at once."""

    def __init__(self, stack, backend) -> None:
        super().__init__()
        self.embed, self.blocks, self.head, self.backend = stack.embed, stack.blocks, stack.head, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
            # compute on device memory dropped at once, while it may still run: the allocator can
            # hand that memory to the next allocation
            self.backend.empty_device(64, torch.float32).fill_(1.0)
        return self.head(x)


def test_a_new_slot_is_filled_after_compute_on_memory_it_may_reuse():
    """The memory a kept slot is replaced with may have been dropped by compute still queued (a
    caching allocator hands it out at once): the first copy into it waits for that compute."""
    backend = chaos_backend()
    model = Scratching(stack(), backend)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    kept = []
    hook = model.blocks[0].layers[0].register_forward_hook(lambda m, a, o: kept.append(m.weight.detach()))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert handle.stats()["retired_slot_bytes"] == handle.describe()[0]["slot_bytes"]
    hook.remove()
    handle.disable()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("grad", [False, True])
def test_a_block_output_that_views_a_weight(depth, grad):
    """Each block's weight view is read after every block ran, with and without autograd: the
    output and the input gradient equal those without offload."""
    model = Viewing(stack())
    reference = copy.deepcopy(model)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=chaos_backend())
    results = []
    for m in (reference, model):
        with torch.set_grad_enabled(grad):
            xi = x.clone().requires_grad_(grad)
            out = m(xi)
            if grad:
                out.square().sum().backward()
        results.append((out.detach(), xi.grad))
    (out_ref, grad_ref), (out, grad_ours) = results
    assert torch.equal(out, out_ref)
    assert grad_ours is None if not grad else torch.equal(grad_ours, grad_ref)
    handle.disable()


def test_no_device_memory_for_a_new_slot_is_a_clear_error():
    """Where the device cannot give a kept slot's memory away, the next load refuses, naming the
    block, and the model keeps working once the reference is dropped."""
    model = stack()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    probe = offload_core.enable_offload(copy.deepcopy(model), enable_layerwise_offload=True, backend=chaos_backend())
    needed = probe.describe()[0]["device_weight_bytes"]
    probe.disable()
    backend = chaos_backend(device_memory=needed)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    kept = []
    hook = model.blocks[0].layers[0].register_forward_hook(lambda m, a, o: kept.append(m.weight.detach()))
    with torch.no_grad(), pytest.raises(offload_core.OffloadedModelError, match="block blocks.0"):
        model(x)
    hook.remove()
    kept.clear()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    handle.disable()


@pytest.mark.parametrize("depth", [1, 2])
def test_a_weight_changed_between_forward_and_backward_is_refused_as_without_offload(depth):
    """Autograd refuses a backward that needs a weight changed in place since the forward; so does
    the offloaded model, for the blocks it reloads and for those still in their slots alike."""
    model, reference, inputs = pair("wan-t2v", trainable=True)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth,
                                         backend=chaos_backend())
    for m, match in ((reference, "modified by an inplace operation"), (model, "modified in place after the forward")):
        for block in (0, -1):  # reloaded for backward / still in its slot when backward starts
            loss = loss_of(m, inputs)
            with torch.no_grad():
                m.blocks[block].ffn.net[2].weight.mul_(1.5)
            with pytest.raises(RuntimeError, match=match):
                loss.backward()
    x = leaf_inputs(inputs)
    loss_of(model, x).backward()  # the model is usable after the refusal
    assert x["hidden_states"].grad is not None
    loss = loss_of(model, inputs)
    handle.disable()
    with pytest.raises(RuntimeError, match="offload was disabled or re-packed"):
        loss.backward()


def test_a_backward_that_raised_is_over_when_the_next_one_starts():
    """A backward that raised before its end (a hook failed) leaves no trace: another graph's
    backward right after it, an optimizer step that writes the host weights, and the forward after
    that are exact."""
    model, reference, inputs = pair("flux2", trainable=True)
    handle = enable(model, "layerwise1")
    results = []
    for m in (reference, model):
        failing, ok = leaf_inputs(inputs), leaf_inputs(inputs)
        doomed, loss = loss_of(m, failing), loss_of(m, ok)
        failing["hidden_states"].register_hook(lambda grad: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            doomed.backward()
        m.zero_grad()
        loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        with torch.no_grad():
            results.append((input_grads(ok), first_tensor(m(**inputs))))
    (grads_ref, out_ref), (grads, out) = results
    assert_equal(grads, grads_ref, "input gradients after a failed backward")
    assert torch.equal(out, out_ref)
    handle.disable()


def test_model_level_backward_reads_the_device_copy_the_forward_used():
    """Autograd saves a parameter as itself (a norm's weight in a product) and reads what it shows at
    backward; model-level has sent the component home by then: the saved weight must still be the
    device copy its forward used, not the host copy (on an accelerator, another device)."""
    model, _, inputs = pair("flux2", trainable=False)
    handle = enable(model, "model")
    part = handle.parts[0]
    homes = [buf for group in part.groups for c in group.components for buf in c.unit.host.values()]
    loss = loss_of(model, leaf_inputs(inputs))
    saved = []
    nodes, seen = [loss.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved += [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        nodes += [next_node for next_node, _ in node.next_functions]
    saved = [t for t in saved if isinstance(t, torch.Tensor) and t.numel()]
    assert saved, "no saved weight found"

    def at_home(t):
        return any(h.data_ptr() <= t.data_ptr() < h.data_ptr() + h.nbytes for h in homes)

    assert not any(at_home(t) for t in saved), "backward would read the host copy"
    loss.backward()
    handle.disable()


class _SavesWeight(torch.autograd.Function):
    """A custom op that saves the (quantized) weight object itself for its backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x @ weight.dequantize().t()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.dequantize(), None


class _QuantizedLayer(torch.nn.Module):
    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return x + torch.tanh(_SavesWeight.apply(x, self.linear.weight))


class _QuantizedStack(torch.nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        g = torch.Generator().manual_seed(3)
        self.blocks = torch.nn.ModuleList()
        for _ in range(blocks):
            linear = torch.nn.Linear(8, 8, bias=False)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(8, 8, generator=g) * 0.3)
            quantize_(linear, Int8WeightOnlyConfig(version=2), filter_fn=lambda module, name: True)
            self.blocks.append(_QuantizedLayer(linear))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_saved_quantized_weight_is_reloaded_part_by_part():
    """A wrapper subclass saved whole (torchao's ``Int8Tensor``) is packed through its parts: the
    input gradient equals the one without offload."""
    pytest.importorskip("torchao")
    model = _QuantizedStack()
    model.requires_grad_(False)
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    grads = []
    for m in (reference, model):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
        m(x).square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert handle.stats()["prefetch_misses"] == 0
    # what backward reads is the device copy of the weight's parts, not the parameter's host copy
    out = model(torch.randn(3, 8, requires_grad=True))
    node = out.grad_fn.next_functions[1][0].next_functions[0][0]  # add <- tanh <- the custom op
    (saved,) = node.saved_tensors
    homes = [buf for unit in handle.parts[0].units for buf in unit.host.values()]
    parts = [getattr(saved, name) for name in saved.__tensor_flatten__()[0]]
    assert not any(h.data_ptr() <= p.data_ptr() < h.data_ptr() + h.nbytes for p in parts for h in homes)
    handle.disable()


def test_a_view_a_finished_transfer_lets_go_of_at_synchronize_is_not_a_kept_slot():
    """A transfer that has finished may still hold a view of its slot until its stream is
    synchronized (a collective's work object, a stream's last task): before judging a slot kept,
    the copy stream is synchronized and the slot counted again, so no slot is replaced for it."""
    model = stack()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    part = handle.parts[0]
    held = [buffer.view(-1) for buffer in part.slots[0].values()]  # what a finished transfer still holds
    stream, synchronize = part.copy_stream, part.copy_stream.synchronize

    def synchronize_and_let_go():
        synchronize()
        held.clear()

    stream.synchronize = synchronize_and_let_go
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    finally:
        del stream.synchronize
    assert not held and handle.stats()["retired_slot_bytes"] == 0
    handle.disable()
