"""The contract across phase switches (docs/design.md): a pipeline under a device budget whose
streamed components park while other phases run keeps every promise of an offloaded model: changes
made between calls reach the next call, training is exact, an interrupt anywhere in a switch
leaves the pipeline usable, and distributed layerwise offload never parks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core.planning import Component, Phase, make_plan

from helpers import chaos_backend, pipeline_reference

pytestmark = pytest.mark.fake_only("the fake's device capacity is set to the budget")


def experts_pipeline(layers: int = 6):
    """Tiny Wan2.2 T2V whose two experts (``layers`` blocks each) hold most of the weights."""
    from diffusers import WanPipeline

    from offload_core.tiny.spec import _finish
    from offload_core.tiny.videos import WAN_T2V_BOUNDARY_RATIO, _wan22_call, _wan22_components, _wan_scheduler

    components = _wan22_components(0, num_layers=layers, num_attention_heads=2, attention_head_dim=16, ffn_dim=256)
    pipe = WanPipeline(scheduler=_wan_scheduler(), boundary_ratio=WAN_T2V_BOUNDARY_RATIO, **components)
    return _finish("wan2.2-t2v-experts", pipe, _wan22_call(num_inference_steps=4), "frames")


def expert_bytes(tiny) -> int:
    return sum(p.numel() * p.element_size() for p in tiny.pipe.transformer.parameters())


def parked_pipeline(backend=None):
    """The pipeline, offloaded under one expert's bytes (its components park), and its reference."""
    tiny = experts_pipeline()
    reference = experts_pipeline()
    budget = expert_bytes(tiny)
    handle = offload_core.enable_offload(tiny.pipe, device_memory=budget, activation_memory=0,
                                         backend=backend or chaos_backend(device_memory=budget))
    assert all(c.parks for c in handle.plan.components if c.kind == "dit"), handle.plan
    return tiny, reference, handle


def edit(pipe, kept: int) -> None:
    """Changes made between calls, to a parked expert and to the one that ran last: an in-place
    edit of a weight of block ``kept`` (kept on the device while its expert runs), new data for a
    weight outside the blocks, a state dict loaded into a block."""
    with torch.no_grad():
        pipe.transformer.blocks[kept].ffn.net[0].proj.weight.mul_(1.5)
        head = pipe.transformer_2.proj_out.weight
        head.data = head.data * 0.5
        block = pipe.transformer_2.blocks[1]
        block.load_state_dict({k: v * 0.75 for k, v in block.state_dict().items()})


def test_changes_between_calls_reach_a_parked_component():
    tiny, reference, handle = parked_pipeline()
    assert torch.equal(tiny.run(), pipeline_reference(reference))
    kept = handle.plan.component("transformer").resident_blocks[0]
    edit(tiny.pipe, kept)
    edit(reference.pipe, kept)
    for _ in range(2):
        assert torch.equal(tiny.run(), pipeline_reference(reference))
    assert handle.stats()["switch_h2d_bytes"] > 0, "the experts parked and came back"
    handle.disable()
    for name in ("transformer", "transformer_2"):
        ours, theirs = getattr(tiny.pipe, name).state_dict(), getattr(reference.pipe, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name


def test_training_through_both_experts_is_exact_and_a_graph_keeps_an_expert_from_parking():
    """A loss over both experts' outputs: the first expert's forward saved weights for the
    backward, so the second's switch does not park it (the device then holds both); gradients and
    two optimizer steps equal the same training without offload."""
    tiny, reference, handle = parked_pipeline(chaos_backend())  # no capacity: both experts may be held
    for pipe in (tiny.pipe, reference.pipe):
        for model in (pipe.transformer, pipe.transformer_2):
            model.requires_grad_(True)
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    context = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([500.0])
    models = [[p.transformer, p.transformer_2] for p in (tiny.pipe, reference.pipe)]
    params = [[q for m in pair for q in m.parameters()] for pair in models]
    optimizers = [torch.optim.SGD(ps, lr=0.1) for ps in params]
    for _ in range(2):
        for pair, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            out = pair[0](latents, t, context, return_dict=False)[0]
            out = pair[1](out, t, context, return_dict=False)[0]
            out.square().mean().backward()
        for (ours, theirs) in zip(*params):
            assert torch.equal(ours.grad, theirs.grad)
        for optimizer in optimizers:
            optimizer.step()
    handle.disable()
    for ours, theirs in zip(*params):
        assert torch.equal(ours, theirs)


ROOT = str(Path(offload_core.__file__).parent)
#: the code of a phase switch: parking, loading back, the held weights
SWITCH_CODE = ("strategies/held.py", "strategies/phases.py")


class Interrupt(KeyboardInterrupt):
    pass


def switch_lines(run) -> list[tuple[str, int]]:
    """The lines of the switch's code ``run`` reaches, and those of the part's park and unpark."""
    from offload_core.strategies.layerwise import LayerwiseOffload

    methods = {LayerwiseOffload.park.__code__, LayerwiseOffload.unpark.__code__,
               LayerwiseOffload._send_held_home.__code__, LayerwiseOffload._drop_device.__code__,
               LayerwiseOffload._fill.__code__, LayerwiseOffload._allocate.__code__}
    reached: dict[tuple[str, int], None] = {}

    def trace(frame, event, arg):
        code = frame.f_code
        if code in methods or code.co_filename.startswith(ROOT) and code.co_filename.endswith(SWITCH_CODE):
            return lambda f, e, a: reached.setdefault((f.f_code.co_filename, f.f_lineno)) if e == "line" else None
        return None

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
    return list(reached)


def interrupted_at(where: tuple[str, int], run) -> bool:
    fired = []

    def line(frame, event, arg):
        if event == "line" and not fired and (frame.f_code.co_filename, frame.f_lineno) == where:
            fired.append(where)
            raise Interrupt(f"{where[0]}:{where[1]}")
        return line

    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename == where[0] else None)
    try:
        run()
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


def test_an_interrupt_at_any_line_of_a_phase_switch_leaves_the_pipeline_usable():
    tiny, reference, handle = parked_pipeline(chaos_backend())
    expected = pipeline_reference(reference)
    assert torch.equal(tiny.run(), expected)
    lines = switch_lines(tiny.run)
    assert len(lines) > 40, "the switch's code was reached"
    handle.disable()
    for where in lines[:: max(1, len(lines) // 60)]:
        tiny, _, handle = parked_pipeline(chaos_backend())
        assert torch.equal(tiny.run(), expected)
        assert interrupted_at(where, tiny.run), where
        assert torch.equal(tiny.run(), expected), where
        handle.disable()
        assert torch.equal(tiny.run(), expected), where


def test_distributed_layerwise_offload_never_parks():
    dits = [Component(name, "dit", 1000, (40_000,) * 8) for name in ("transformer", "transformer_2")]
    phases = [Phase("denoise transformer", ("transformer",), forwards_per_step=1, share=0.5),
              Phase("denoise transformer_2", ("transformer_2",), forwards_per_step=1, share=0.5)]
    alone = make_plan(dits, 300_000, phases=phases, steps=10)
    assert alone.strategy == "layerwise" and all(c.parks for c in alone.components)
    ranks = make_plan(dits, 300_000, phases=phases, steps=10, world_size=2, strategy="distributed")
    assert ranks.strategy == "distributed" and not any(c.parks for c in ranks.components)
    assert all(c.mode == "streamed" for c in ranks.components)


def test_a_kept_block_of_a_parked_component_called_on_its_own_loads_it_back():
    """A block kept on the device, called outside a pipeline call while its component is parked,
    brings the component back (as a streamed block does) and computes what it computes without
    offload."""
    tiny, reference, handle = parked_pipeline()
    kept = handle.plan.component("transformer").resident_blocks[0]
    seen = []
    hook = reference.pipe.transformer.blocks[kept].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args, kwargs)) if not seen else None, with_kwargs=True)
    pipeline_reference(reference)
    hook.remove()
    tiny.run()
    (args, kwargs), before = seen[0], handle.stats()["switch_h2d_bytes"]
    with torch.no_grad():
        ours = tiny.pipe.transformer.blocks[kept](*args, **kwargs)
        theirs = reference.pipe.transformer.blocks[kept](*args, **kwargs)
    assert torch.equal(ours, theirs)
    assert handle.stats()["switch_h2d_bytes"] > before, "the component was parked and came back"
    handle.disable()
