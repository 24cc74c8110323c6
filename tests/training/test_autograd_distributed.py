"""Autograd through distributed layerwise offload on 2 real processes (gloo), on real diffusers
DiTs: input gradients of a frozen model, sharded and replicated, a 5-step LoRA training loop and full
fine-tuning with replicated host weights, torch.autograd.grad, retain_graph, gradient
checkpointing and autocast, all equal to the same model without offload bit for bit; a sharded
block whose weights require grad is refused clearly on every rank, and the ranks stay in step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port

WORLD = 2
MODELS = ["flux2", "qwen-image", "wan-t2v"]

pytestmark = pytest.mark.fake_only  # the ranks run on the fake backend over gloo


def _worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ helpers in the spawned process
    torch.set_num_threads(1)
    import offload_core
    from denoisers import build_transformer
    from grads import assert_equal, input_grads, leaf_inputs, loss_of

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    peft = pytest.importorskip("peft")
    for name in MODELS:
        for shard in (True, False):
            model, inputs = build_transformer(name)
            model.requires_grad_(False)
            reference = copy.deepcopy(model)
            expected = leaf_inputs(inputs)
            loss_of(reference, expected).backward()
            handle = offload_core.enable_offload(
                model, enable_distributed_layerwise_offload=True, backend=backend, shard_host_weights=shard
            )
            for step in range(2):
                got = leaf_inputs(inputs)
                loss_of(model, got).backward()
                assert_equal(input_grads(got), input_grads(expected), f"{name} shard={shard} step {step} rank {rank}")
            stats = handle.stats()
            assert stats["prefetch_misses"] == 0 and stats["retired_slot_bytes"] == 0
            part = handle.describe()[0]
            assert stats["loads"] == 2 * (2 * len(part["streamed_blocks"]) - part["slots"])
            block = next(p for n, p in model.named_parameters() if ".0." in n)
            if shard:  # a shard cannot be trained: a clear error on every rank, and still in step
                block.requires_grad_(True)
                with pytest.raises(offload_core.DistributedOffloadError, match="freeze them"):
                    loss_of(model, leaf_inputs(inputs)).backward()
                block.requires_grad_(False)
                got = leaf_inputs(inputs)
                loss_of(model, got).backward()
                assert_equal(input_grads(got), input_grads(expected), f"{name} after a refused backward")
            handle.disable()
        _lora_loop(offload_core, backend, peft, name, build_transformer, assert_equal, loss_of)
    _every_kind(offload_core, backend, build_transformer)


def _every_kind(offload_core, backend, build_transformer) -> None:
    """The other gradient cases on one DiT: sharded and frozen, torch.autograd.grad with
    retain_graph and two backward passes, gradient checkpointing and autocast; replicated, full
    fine-tuning with optimizer steps."""
    from grads import assert_equal, fine_tune_alike, input_grads, leaf_inputs, loss_of

    model, inputs = build_transformer("flux2")
    model.requires_grad_(False)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.enable_gradient_checkpointing()
        m.train()
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
    results = []
    for m in (reference, model):
        x = leaf_inputs(inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(m, x)
        first = torch.autograd.grad(loss, [x["hidden_states"]], retain_graph=True)[0]
        loss.backward(retain_graph=True)
        loss.backward()
        results.append((first, input_grads(x)))
    assert torch.equal(results[0][0], results[1][0]), "autograd.grad differs"
    assert_equal(results[1][1], results[0][1], "input gradients after two backward passes")
    handle.disable()

    model, inputs = build_transformer("flux2")
    model.requires_grad_(True)
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(
        model, enable_distributed_layerwise_offload=True, backend=backend, shard_host_weights=False
    )
    fine_tune_alike(model, reference, inputs, steps=2)
    handle.disable()
    assert_equal(dict(model.state_dict()), dict(reference.state_dict()), "weights after disable")


def _lora_loop(offload_core, backend, peft, name, build_transformer, assert_equal, loss_of) -> None:
    model, inputs = build_transformer(name)
    model.requires_grad_(False)
    config = peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_v"])
    torch.manual_seed(0)
    model.add_adapter(config)
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(
        model, enable_distributed_layerwise_offload=True, backend=backend, shard_host_weights=False
    )
    loops = []
    for m in (model, reference):
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        loops.append((m, params, torch.optim.AdamW(params.values(), lr=1e-2)))
    for step in range(5):
        for m, params, opt in loops:
            opt.zero_grad()
            loss_of(m, inputs).backward()
            opt.step()
        ours, theirs = ({n: p.detach().clone() for n, p in params.items()} for _, params, _ in loops)
        assert_equal(ours, theirs, f"{name} LoRA weights after step {step}")
    handle.disable()


def test_gradients_through_distributed_offload_on_two_ranks():
    mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=True, start_method="spawn")
