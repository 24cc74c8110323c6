"""``python -m offload_core.bench.realsize`` (the GPU check's real-size step), at its tiny dry-run
size on the fake backend: it runs the transformer as ``WanPipeline`` does, two calls per step with
guidance and a scheduler step between, offload-core's calls inside ``handle.frozen()``."""

from __future__ import annotations

import torch

import offload_core
from offload_core.bench import realsize


def test_a_step_is_two_guided_calls_and_a_scheduler_step():
    backend = offload_core.get_backend("fake", chaos=False)
    model = realsize.build_wan(realsize.TINY)
    inputs = realsize.make_inputs(realsize.TINY_INPUTS, torch.bfloat16)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["encoder_hidden_states"]),
                                    with_kwargs=True)
    times, latents = realsize.denoise(backend, model, inputs, steps=3)
    assert len(times) == 3 and len(seen) == 6
    assert all(a is inputs["cond"] and b is inputs["uncond"] for a, b in zip(seen[::2], seen[1::2]))
    assert latents.shape == inputs["latents"].shape and not torch.equal(latents, inputs["latents"])


def test_every_variant_runs_the_pipeline_pattern_and_offload_core_is_exact():
    backend = offload_core.get_backend("fake", chaos=False)
    result = realsize.run(backend, realsize.TINY, realsize.TINY_INPUTS, steps=1, memcpy_bytes=1 << 20)
    variants = result["variants"]
    assert set(variants) == {"resident", "layerwise_depth1", "layerwise_depth2", "diffusers_group_offload"}
    assert variants["layerwise_depth1"]["exact"] and variants["layerwise_depth2"]["exact"]
    assert variants["diffusers_group_offload"]["use_stream"] is False  # the fake's device is the CPU
    assert all(len(v["step_s"]) == 1 for v in variants.values()) and "frozen()" in result["call_pattern"]
    # every block streams in each of the two calls of each step (the warm-up step counted)
    blocks = realsize.TINY["num_layers"]
    assert variants["layerwise_depth1"]["h2d_copies_per_step"] >= 2 * blocks
