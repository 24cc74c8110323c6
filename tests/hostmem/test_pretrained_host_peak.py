"""Host memory of ``offload_core.from_pretrained`` on a pipeline bigger than its budget: a tiny
Wan 2.2 pipeline whose UMT5 text encoder (67 MB, 16 blocks of 4.2 MB) is twice ``host_memory``,
loaded with ``components=("dit", "text_encoder")``, peaks at the budget plus one block (the
encoder's blocks beyond the budget stay in its own checkpoint), and its output equals diffusers'
own load without offload. Measured in a fresh process (see offload_core/bench/hostmem.py for how
peaks are taken); run as a script, this file is that process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

MiB = 2**20
HOST_MEMORY = 32 * MiB
#: what a process grows by while loading besides the weights: tokenizer, configs, Python objects
#: and the C heap's slack between trims (the imports are made before the baseline)
SLACK = 12 * MiB
ENCODER = dict(d_model=256, d_kv=32, num_heads=8, d_ff=1024, num_layers=16, relative_attention_num_buckets=8)


def write_pipeline(folder) -> None:
    """The zoo's Wan 2.2 pipeline with a bigger UMT5 encoder (and DiTs reading its width)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from offload_core.tiny import build_pipeline
    from offload_core.tiny.encoders import finish, seeded
    from offload_core.tiny.transformers import build_dit

    tiny = build_pipeline("wan2.2-t2v")
    tokenizer = tiny.pipe.tokenizer
    with seeded(0):
        config = UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                            **ENCODER)
        encoder = finish(UMT5EncoderModel(config))
        transformers = [build_dit("wan-t2v", text_dim=ENCODER["d_model"]) for _ in range(2)]
    tiny.pipe.register_modules(text_encoder=encoder, transformer=transformers[0], transformer_2=transformers[1])
    tiny.pipe.save_pretrained(folder)


def measure(folder: str, out: str) -> dict:
    """In this fresh process: the load's and the call's host peaks above the baseline (the fake
    device's memory, host memory here, taken out), and both outputs saved to ``out``."""
    torch.set_num_threads(1)
    import diffusers  # noqa: F401 - everything the load imports, imported before the baseline
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel  # noqa: F401
    from transformers import T5TokenizerFast, UMT5EncoderModel  # noqa: F401

    import offload_core
    import offload_core.pretrained.encoders  # noqa: F401
    from offload_core.bench.hostmem import Peak, rss
    from offload_core.hostmem.machine import return_free_memory
    from offload_core.tiny import TinyPipeline, build_pipeline

    call = build_pipeline("wan2.2-t2v").call_kwargs
    backend = offload_core.get_backend("fake", chaos=False, sanitize=False)
    allocate = backend.empty_device
    backend.empty_device = lambda size, dtype=torch.uint8: allocate(size, dtype).zero_()  # there once allocated
    return_free_memory()
    base = rss()
    with Peak() as load:
        handle = offload_core.from_pretrained(folder, enable_layerwise_offload=True, components=("dit", "text_encoder"),
                                              host_memory=HOST_MEMORY, backend=backend)
    device = backend.memory_allocated()
    pipe = handle.target
    pipe.set_progress_bar_config(disable=True)
    tiny = TinyPipeline("offloaded", pipe, call, "frames")
    first = tiny.run(seed=0)  # its first call imports and builds what calls need; the second is measured
    before = rss()
    with Peak() as step:
        got = tiny.run(seed=0)
    assert torch.equal(got, first)
    streamed = [p for p in handle.parts if getattr(p, "units", None)]
    encoder_part = next(p for p in streamed if getattr(p, "model", None) is pipe.text_encoder)
    report = {
        "load": load.peak - base - device,
        "call_growth": step.peak - before,
        "block": max(u.nbytes for p in streamed for u in p.units),
        "encoder_bytes": sum(p.numel() * p.element_size() for p in pipe.text_encoder.parameters()),
        "encoder_units_on_disk": sum(u.image is not None for u in encoder_part.units),
        "encoder_units": len(encoder_part.units),
        **{k: handle.stats()[k] for k in ("disk_bytes", "host_bytes")},
    }
    handle.disable()
    del handle, pipe
    reference = diffusers.WanPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected = TinyPipeline("reference", reference, call, "frames").run(seed=0)
    torch.save({"got": got, "expected": expected}, out)
    return report


def test_a_pipeline_bigger_than_host_memory_loads_within_the_budget_plus_one_block(tmp_path):
    folder, out = tmp_path / "wan", tmp_path / "outputs.pt"
    write_pipeline(folder)
    done = subprocess.run([sys.executable, __file__, str(folder), str(out)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["encoder_bytes"] > 2 * HOST_MEMORY
    # the encoder streams, its last blocks read from its own checkpoint (no spill folder was given)
    assert 0 < report["encoder_units_on_disk"] < report["encoder_units"]
    assert report["disk_bytes"] > report["encoder_bytes"] - HOST_MEMORY
    bound = HOST_MEMORY + report["block"] + SLACK
    assert report["load"] <= bound, report
    # a call reads the blocks on disk (more than the budget) through the bounce ring: RAM grows by
    # at most a block's worth, never by what it reads
    assert report["call_growth"] <= report["block"] + SLACK, report
    outputs = torch.load(out)
    assert torch.equal(outputs["got"], outputs["expected"])


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    start = time.perf_counter()
    print(json.dumps({**measure(*sys.argv[1:]), "seconds": time.perf_counter() - start}))
elif __name__ != "__main__":
    pytestmark = pytest.mark.filterwarnings("ignore")
