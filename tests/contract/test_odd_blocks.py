"""Blocks with a float8 weight, a complex buffer and an int counter under hooks that return new
tensors, grad modes, attribute writes during forward and six threads; and, on plain stacks, the
torch.func transforms, ``share_memory`` and a re-pack out of device memory (docs/design.md,
contract rows 13, 20, 22 and 23): each case exact against the same model without offload
(``torch.equal``) or a clear error that leaves the model usable."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import offload_core
from offload_core.base.errors import OffloadedModelError, RepackError

from contract_models import ENABLE_OPTIONS
from helpers import chaos_backend
from stacks import StackSpec, build_stack

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))


def pair():
    model = build_stack(StackSpec())
    return model, copy.deepcopy(model)


def enable(model, strategy, **options):
    return offload_core.enable_offload(model, backend=chaos_backend(**options), **ENABLE_OPTIONS[strategy])


def same(model, reference, x=X) -> None:
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def params_of(model) -> dict:
    return {k: v.detach() for k, v in model.named_parameters()}


def loss_with(params, model):
    return functional_call(model, params, (X,)).square().sum()


# -- item 10: torch.func transforms -----------------------------------------------------------
@pytest.mark.parametrize("transform", [grad, jacrev], ids=["grad", "jacrev"])
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_torch_func_grad_and_jacrev_are_refused_clearly_and_leave_the_model_usable(strategy, transform):
    model, reference = pair()
    handle = enable(model, strategy)
    with pytest.raises(OffloadedModelError, match="torch.func.grad.*handle.disable"):
        transform(loss_with)(params_of(model), model)
    same(model, reference)
    handle.disable()
    same(model, reference)
    got, want = (transform(loss_with)(params_of(m), m) for m in (model, reference))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_vmap_through_an_offloaded_model_is_exact(strategy):
    model, reference = pair()
    handle = enable(model, strategy)
    xs = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(vmap(model)(xs), vmap(reference)(xs))
    handle.disable()


# -- item 11: a re-pack that runs out of device memory ------------------------------------------
def test_a_repack_out_of_device_memory_raises_its_repack_error_and_the_model_runs_without_offload():
    model, reference = pair()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    handle = enable(model, "layerwise", device_memory=nbytes * 3)
    same(model, reference)
    for m in (model, reference):  # every block grows: the new slots do not fit
        torch.manual_seed(7)
        for block in m.blocks:
            block.layers[0].extra = nn.Linear(8, 64)
    with pytest.raises(RepackError, match="offloading is now off"):
        same(model, reference)
    same(model, reference)
    handle.disable()
    same(model, reference)


# -- item 8: share_memory ---------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_share_memory_of_an_offloaded_model_is_refused_and_works_after_disable(strategy):
    model, reference = pair()
    handle = enable(model, strategy)
    with pytest.raises(OffloadedModelError, match="share_memory.*handle.disable"):
        model.share_memory()
    same(model, reference)
    handle.disable()
    model.share_memory()
    assert all(p.is_shared() for p in model.parameters())
    same(model, reference)


# -- the third adversarial round --------------------------------------------------------------
class Odd(nn.Module):
    """A block with what the round needs: a float8 weight, a complex buffer, an int counter."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.f8 = nn.Parameter((torch.randn(8, 8, generator=g) * 0.3).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("phase", torch.polar(torch.ones(8), torch.randn(8, generator=g)))
        self.register_buffer("calls", torch.zeros(1, dtype=torch.int64))
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 8, generator=g) * 0.3)
            self.lin.bias.copy_(torch.randn(8, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        y = self.lin(x) + x @ self.f8.to(x.dtype)
        return torch.tanh(y * self.phase.real.to(y.dtype) + self.calls.to(y.dtype) * 0.01)


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.blocks = nn.ModuleList([Odd(g) for _ in range(3)])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _hook_new_output(m):
    m.blocks[1].register_forward_hook(lambda mod, args, out: out * 2 + 1)


def _pre_hook_new_args(m):
    m.blocks[0].register_forward_pre_hook(lambda mod, args: (args[0].flip(0),))


def _pre_hook_kwargs_new(m):
    m.blocks[2].register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)


def _always_call_hook(m):
    m.blocks[1].register_forward_hook(lambda mod, args, out: out.clamp(-0.5, 0.5), always_call=True)


def _no_grad_method(m):
    block = m.blocks[1]
    block.forward = torch.no_grad()(block.forward)


def _enable_grad_inside(m):
    block = m.blocks[0]
    inner = block.forward

    def forward(x):
        with torch.enable_grad():
            return inner(x)

    block.forward = forward


def _setattr_tensor_in_forward(m):
    def keep(mod, args, out):
        mod.last = out.detach().clone()  # nn.Module.__setattr__ of a plain tensor during forward
        return out + mod.last * 0

    for block in m.blocks:
        block.register_forward_hook(keep)


def _setattr_weight_product(m):
    def keep(mod, args, out):
        mod.gram = (mod.lin.weight @ mod.lin.weight.t()).clone()
        return out

    m.blocks[2].register_forward_hook(keep)


def _block_twice(m):
    def forward(x):
        x = m.embed(x) if hasattr(m, "embed") else x
        for block in m.blocks:
            x = block(x)
        x = m.blocks[0](x)  # a block reused after the others
        return m.head(x)

    m.forward = forward


def _model_no_grad(m):
    m.forward = torch.no_grad()(m.forward)


def _grad_hook_on_output(m):
    def hook(mod, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: g * 3)

    m.blocks[1].register_forward_hook(hook)


def _frozen_one_weight(m):
    m.blocks[1].lin.bias.requires_grad_(False)


def _requires_grad_in_pre_hook(m):
    def hook(mod, args):
        mod.blocks[2].lin.weight.requires_grad_(False)

    m.register_forward_pre_hook(hook)


def _state_dict_hook(m):
    m.blocks[0]._register_state_dict_hook(lambda mod, state, prefix, local: state)


def _apply_read_only(m):
    m.apply(lambda mod: mod.weight.sum() if isinstance(mod, nn.Linear) else None)


def _dropout_in_train(m):
    m.train()
    for block in m.blocks:
        block.register_forward_hook(lambda mod, args, out: nn.functional.dropout(out, 0.3, training=True))


def _replace_buffer_same_shape(m):
    with torch.no_grad():
        m.blocks[1].register_buffer("phase", m.blocks[1].phase * 1j)


def _replace_buffer_other_shape(m):
    m.blocks[1].register_buffer("phase", torch.ones(1, dtype=torch.complex64))


def _new_buffer(m):
    m.blocks[2].register_buffer("extra", torch.ones(8))
    m.blocks[2].register_forward_hook(lambda mod, args, out: out + mod.extra)


def _to_float64(m):
    m.blocks[0].lin.double()
    inner = m.blocks[0].forward
    m.blocks[0].forward = lambda x: inner(x.double()).float()


def _weight_read_in_hook(m):
    m.blocks[2].register_forward_pre_hook(lambda mod, args: (args[0] + mod.lin.weight.sum() * 0.01,))


def _einsum_transposed(m):
    m.blocks[1].register_forward_hook(lambda mod, args, out: out + torch.einsum("bi,ij->bj", out, mod.lin.weight.T))


def _counter_write_in_hook(m):
    def count(mod, args):
        mod.calls[0] += 10

    m.blocks[0].register_forward_pre_hook(count)


def _complex_buffer_in_place(m):
    def hook(mod, args):
        mod.phase.mul_(1j)

    m.blocks[2].register_forward_pre_hook(hook)


def _inference_mode(m):
    m.forward = torch.inference_mode()(m.forward)


def _kwargs_call(m):
    inner = m.forward
    m.forward = lambda x=None, scale=1.0: inner(x) * scale


def _named_parameters_in_forward(m):
    m.register_forward_hook(lambda mod, args, out: out + sum(p.float().sum() for _, p in mod.named_parameters()) * 0)


def _float8_edit_between(m):
    with torch.no_grad():
        m.blocks[0].f8.copy_((m.blocks[0].f8.float() * 0.5).to(torch.float8_e4m3fn))


def _tuple_output(m):
    m.blocks[1].register_forward_hook(lambda mod, args, out: out)
    inner = m.blocks[1].forward
    block = m.blocks[1]
    block.forward = lambda x: inner(x)


ROUND3 = {name[1:]: fn for name, fn in dict(globals()).items() if name.startswith("_") and callable(fn)
          and fn.__module__ == __name__ and name not in ("_enable",) and fn.__code__.co_varnames[:1] == ("m",)}


def _run(m, step: int, grad_too: bool) -> list[torch.Tensor]:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
    torch.manual_seed(step)
    if not grad_too:
        with torch.no_grad():
            return [m(x).clone()]
    x.requires_grad_(True)
    out = m(x)
    if not out.requires_grad:
        return [out.detach().clone()]
    out.square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad(set_to_none=True)
    return [out.detach().clone(), x.grad.clone() if x.grad is not None else torch.zeros(0), *grads]


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("case", sorted(ROUND3))
def test_round_three_acts_as_without_offload(strategy, case):
    model = OddModel()
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    with torch.no_grad():
        assert torch.equal(model(X), reference(X))
    for m in (model, reference):
        ROUND3[case](m)
    for step, grad_too in ((1, False), (2, True), (3, False)):
        got, want = _run(model, step, grad_too), _run(reference, step, grad_too)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), (case, step)
    handle.disable()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(_run(model, 4, False), _run(reference, 4, False)))


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_an_offloaded_model_called_from_threads_reused_across_them_is_exact(strategy):
    """Six threads share one offloaded model whose output depends on how often it ran: the calls
    are serialised (the handle's lock); replayed in the order they took it, the model without
    offload gives the same outputs."""
    model = OddModel().eval()
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    order: list[int] = []
    model.register_forward_pre_hook(
        lambda mod, args: order.append(next(k for k, x in enumerate(inputs) if torch.equal(x, args[0].cpu())))
    )
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        with torch.no_grad():
            results[k] = model(inputs[k]).cpu()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.disable()
    assert sorted(order) == list(range(6))
    with torch.no_grad():
        for k in order:
            assert torch.equal(results[k], reference(inputs[k])), k
