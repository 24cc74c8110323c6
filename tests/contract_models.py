"""Models and checks shared by the contract tests (docs/design.md, "What you can do to an
offloaded model"): a block stack whose forward updates buffers and reads block weights outside
the blocks, deterministic inputs, comparisons with the same model without offload, and LoRA state
dicts made in code for the tiny FLUX.2."""

from __future__ import annotations

import torch
from torch import nn

from stacks import Block, Layer, Stack

#: the enable options of each single-process strategy the tests run, by strategy name (one table)
ENABLE_OPTIONS = {"layerwise": {"enable_layerwise_offload": True}, "model": {"enable_cpu_offload": True}}
D = 8


class Counting(nn.Module):
    """A layer whose forward changes its buffers: a step counter in place, a running mean
    replaced by a new tensor; its output depends on both."""

    def __init__(self, d: int, g: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, generator=g) * 0.3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.running = 0.5 * self.running + x.float().mean(0)
        return x + (x.to(self.weight.dtype) @ self.weight).to(x.dtype) * 0.1 + (self.running * self.steps).to(x.dtype)


class Reuse(Stack):
    """Uses block weights outside the blocks' own forwards: a block's child called again after
    the blocks, and a raw read of another block's weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        x = x + self.blocks[0].layers[0](x)
        x = x * self.blocks[2].layers[0].weight.float().mean()
        return self.head(x)


DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32]


def build() -> Reuse:
    g = torch.Generator().manual_seed(0)
    blocks = [Block([Layer(D, dtype, i % 2 == 1, g), Counting(D, g)]) for i, dtype in enumerate(DTYPES)]
    return Reuse(D, blocks, g).eval()


def run(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(step)).to(model.embed.weight.dtype)
    with torch.no_grad():
        return model(x).clone()


def assert_same(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter and buffer (persistent or not) has the reference's value and dtype."""
    ours = dict([*model.named_parameters(), *model.named_buffers()])
    theirs = dict([*reference.named_parameters(), *reference.named_buffers()])
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert torch.equal(ours[name].detach().cpu(), value.detach()), name


def offloaded_ids(handle) -> set[int]:
    """Parameters the handle streams or keeps on the device."""
    return {id(o.param) for part in handle.parts for unit, _, _ in part.truth() for o in unit.owners() if o.param is not None}


def assert_offloaded(handle, model: nn.Module) -> None:
    """Every parameter of the model is one the handle streams or keeps on the device: tensors a
    change brought in (a new Parameter, a module added) travel like the others."""
    owned = offloaded_ids(handle)
    stray = [name for name, p in model.named_parameters() if id(p) not in owned]
    assert not stray, f"not offloaded: {stray}"


def new_state(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in module.state_dict().items():
        if value.dtype.is_floating_point:
            out[key] = torch.randn(value.shape, generator=g).to(value.dtype)
        else:
            out[key] = torch.randint(0, 5, value.shape, generator=g).to(value.dtype)
    return out


class Scaled(nn.Module):
    """A module wrapped around an existing child, with a parameter of its own (as a LoRA layer)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.full((D,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain.to(x.dtype)


def raise_once(error: BaseException):
    """A forward pre-hook that raises ``error`` the first time only."""
    state = {"armed": True}

    def hook(module, args):
        if state["armed"]:
            state["armed"] = False
            raise error

    return hook


def lora_state_dict(transformer, seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    """A LoRA for the attention query/value projections in the blocks and for ``proj_out`` (which
    stays resident under layerwise offload), in the peft layout diffusers loads."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_v")) or name == "proj_out":
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.5
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.5
    return state

