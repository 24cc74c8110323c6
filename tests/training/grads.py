"""Gradients compared bit for bit with the same model without offload: the inputs as leaves, the
loss, the gradients read back and an optimizer run on both models. Shared by the single-process
and the two-rank autograd tests."""

from __future__ import annotations

import torch

from helpers import first_tensor

def leaf_inputs(inputs: dict) -> dict:
    """Floating inputs as fresh leaves that require grad."""
    return {
        k: v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def loss_of(model, inputs: dict) -> torch.Tensor:
    return first_tensor(model(**inputs)).float().square().mean()


def input_grads(inputs: dict) -> dict:
    return {k: v.grad for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.grad is not None}


def param_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal(got: dict, expected: dict, what: str) -> None:
    assert expected and got.keys() == expected.keys(), what
    wrong = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not wrong, f"{what} differ: {wrong[:5]}"


def fine_tune_alike(model, reference, inputs: dict, steps: int) -> None:
    """SGD with momentum on every weight of both models: the gradients before each step and the
    weights after the last are equal."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference)]
    for step in range(steps):
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            loss_of(m, inputs).backward()
        assert_equal(param_grads(model), param_grads(reference), f"weight gradients at step {step}")
        for opt in optimizers:
            opt.step()
    assert_equal(dict(model.state_dict()), dict(reference.state_dict()), "weights after training")

