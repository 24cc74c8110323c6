"""A peft LoRA trained on a DiT stored in float8 (``storage_dtype=``, diffusers' layerwise casting
of the base weights, the adapter's own weights in bfloat16): gradients and the adapter after
AdamW steps ``torch.equal`` to the same model with the same casting and no offload, for layerwise
and model-level offload, while the base weights stay float8 in the homes and on the link. Under
layerwise offload the graph keeps no compute-dtype copy of a streamed weight: each is saved as the
slot view it was cast from, and cast again in backward."""

from __future__ import annotations

import copy

import pytest
import torch

import offload_core
from offload_core.strategies import autograd
from offload_core.weights.binding import CAST_COPIES

from contract_models import ENABLE_OPTIONS
from denoisers import build_transformer
from helpers import chaos_backend, first_tensor

pytest.importorskip("peft")
pytestmark = pytest.mark.fake_only("references are computed on the CPU, as the fake's device")

FP8 = torch.float8_e4m3fn


def with_adapter(name: str):
    """The tiny DiT in bfloat16, frozen, with a LoRA on its attention projections."""
    from peft import LoraConfig

    model, inputs = build_transformer(name)
    model = model.to(torch.bfloat16).requires_grad_(False)
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"))
    to = lambda v: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    return model, {k: to(v) for k, v in inputs.items()}


def loss(model, inputs: dict) -> torch.Tensor:
    return first_tensor(model(**inputs)).float().square().mean()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("name", ["flux2", "wan-t2v"])
def test_lora_on_a_float8_dit_trains_as_without_offload(name, strategy, monkeypatch):
    saved = []  # under layerwise offload, each saved copy of a slot view: what the graph keeps of it
    pack = autograd.SavedSlots._pack

    def recorded(self, t):
        packed = pack(self, t)
        found = CAST_COPIES.get(t.untyped_storage().data_ptr())
        if found is not None and found[1].untyped_storage().data_ptr() in self._slot_of:
            saved.append(type(packed).__name__)
        return packed

    monkeypatch.setattr(autograd.SavedSlots, "_pack", recorded)
    model, inputs = with_adapter(name)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), storage_dtype=FP8, **ENABLE_OPTIONS[strategy])
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and p.dtype == torch.bfloat16 for n, p in trained.items())
    base = [p for n, p in model.named_parameters() if n.endswith(("to_q.base_layer.weight", "to_v.base_layer.weight"))]
    assert base and all(p.dtype == FP8 for p in base), "the adapted layers' base weights are not stored in float8"
    loops = []
    for m in (model, reference):
        params = [p for p in m.parameters() if p.requires_grad]
        loops.append((params, torch.optim.AdamW(params, lr=1e-2)))
    for step in range(2):
        for m, (params, opt) in zip((model, reference), loops):
            opt.zero_grad()
            loss(m, inputs).backward()
        ours, theirs = loops[0][0], loops[1][0]
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True)), f"gradients, step {step}"
        for _, opt in loops:
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), f"adapter after step {step}"
    if strategy == "layerwise":  # no copy of a streamed weight in the graph (resident ones stay on the device anyway)
        assert len(saved) >= 2 * len(base) and set(saved) == {"_Recast"}, saved
    assert not CAST_COPIES, "copies outlive their layer's forward"
    with torch.no_grad():
        assert torch.equal(first_tensor(model(**inputs)), first_tensor(reference(**inputs)))
    handle.disable()
    assert all(p.dtype == FP8 for p in base), "disable() changed the stored dtype"
