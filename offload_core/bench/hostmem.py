"""Host-memory benchmark: peak resident memory (RSS) of each host-side moment of offloading a real
config, as a multiple of the model's bytes, and how fast weights are packed and loaded.

The model is a ``WanTransformer3DModel`` with Wan2.1-1.3B's config (2.8 GB in bf16), its random
weights written once as a safetensors checkpoint in a temporary folder (built on the meta device:
nothing is initialised). Each scenario runs in a fresh Python process, so one scenario's memory
cannot lower or raise another's, and each phase's peak is the kernel's high-water mark, reset
before the phase (``/proc/self/clear_refs``; elsewhere RSS is sampled every millisecond). A
ratio is (peak RSS - RSS before the model existed) / model bytes. On the fake backend "device"
memory is host memory too: it is subtracted, so the figures are what a GPU machine's host holds.
Enable is timed twice, each time right after a plain copy of the same bytes into fresh memory
(both pay the same page faults): the ratio is the median of the two cycles' ratios, with its
spread; the seconds per GB are the faster of the two.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

#: Wan2.1-T2V-1.3B's transformer config
WAN_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
#: the same topology, small: for ``--quick`` smoke runs
QUICK = dict(WAN_1_3B, num_attention_heads=4, attention_head_dim=32, text_dim=256, freq_dim=64, ffn_dim=1024,
             num_layers=6)
GB = 1e9
SLACK = 2**30  # the "+ 1 GB" of the bounds: interpreter, torch, allocator slack


# -- the checkpoint -----------------------------------------------------------------------------
#: the random values every checkpoint tensor is a wrapping slice of: N(0, 0.02) in bf16, an odd
#: number of them, so that tensors of equal shape starting at random places hold different values
NOISE_VALUES = 2**24 + 2**20 + 3


def write_weights(folder: str, model: Any, weights_name: str, max_shard_size: int | str | None = None,
                  seed: int = 0) -> int:
    """Random bf16 values for every tensor of ``model``'s state dict (built on the meta device:
    only names and shapes are read), written as ``save_pretrained`` lays them out: one
    ``weights_name`` file, or shards of at most ``max_shard_size`` split by huggingface_hub's
    rule with their ``<weights_name>.index.json``. Tied tensors are written once, under their
    first name. Only a fixed pool of random values is ever in memory. Returns the tensor bytes."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from tqdm.auto import tqdm

    state, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not t.is_floating_point():
            raise ValueError(f"{type(model).__name__}.{name} is {t.dtype}: random values would not be valid")
        state[name] = torch.empty(t.shape, dtype=torch.bfloat16, device="meta")
    split = split_torch_state_dict_into_shards(
        state, filename_pattern=weights_name.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size or 2**62)
    generator = torch.Generator().manual_seed(seed)
    noise = (torch.randn(NOISE_VALUES, generator=generator) * 0.02).to(torch.bfloat16)
    pool = memoryview(noise.view(torch.uint8).numpy()).cast("B")
    total = sum(t.numel() * 2 for t in state.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(folder)}") as bar:
        for filename, names in split.filename_to_tensors.items():
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name in names:
                size = state[name].numel() * 2
                header[name] = {"dtype": "BF16", "shape": list(state[name].shape),
                                "data_offsets": [offset, offset + size]}
                offset += size
            text = json.dumps(header).encode()
            text += b" " * (-(8 + len(text)) % 64)
            with open(os.path.join(folder, filename), "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for name in names:
                    left = state[name].numel() * 2
                    at = 2 * int(torch.randint(NOISE_VALUES, (1,), generator=generator))
                    while left:
                        piece = pool[at : at + left]
                        f.write(piece)
                        left -= len(piece)
                        bar.update(len(piece))
                        at = 0
                f.flush()
                os.fsync(f.fileno())  # on disk, not dirty in the page cache: readers can start cold
    if split.is_sharded:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        with open(os.path.join(folder, weights_name + ".index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return total


def write_checkpoint(folder: str, config: dict[str, Any]) -> int:
    """A Wan transformer folder (config.json, one safetensors file) with random bf16 weights,
    written without building the model's weights: returns the checkpoint's tensor bytes."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    model.save_config(folder)
    return write_weights(folder, model, "diffusion_pytorch_model.safetensors")


# -- measuring in the child process -------------------------------------------------------------
def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Peak:
    """Peak RSS of the code inside ``with``: the kernel's high-water mark, reset on entry; where
    the kernel offers no reset, RSS sampled every millisecond on a thread."""

    def __enter__(self) -> "Peak":
        self._sampler = None
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        except OSError:
            self._stop = threading.Event()
            self._max = rss()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self.start = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._max = max(self._max, rss())

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
        if self._sampler is None:
            with open("/proc/self/status", encoding="ascii") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            self.peak = int(hwm.split()[1]) * 1024
        else:
            self._stop.set()
            self._sampler.join()
            self.peak = max(self._max, rss())


def _built_model(folder: str):
    """The checkpoint's model with every weight in ordinary memory, as a model built in code."""
    import torch
    from torch import nn
    from diffusers import WanTransformer3DModel

    from ..pretrained.load import build_on_meta
    from ..weights.unit import SOURCE_ATTRIBUTE

    model = build_on_meta(WanTransformer3DModel, folder, torch.bfloat16)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                source = getattr(t, SOURCE_ATTRIBUTE, None)
                if source is None:
                    continue
                real = torch.empty(t.shape, dtype=t.dtype)
                source.read(0, real.numel(), real.view(-1))
                table[name] = nn.Parameter(real, requires_grad=False) if isinstance(t, nn.Parameter) else real
    return model


def _inputs(config: dict[str, Any]):
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, config["in_channels"], 1, 4, 4, generator=g, dtype=torch.bfloat16),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 4, config["text_dim"], generator=g, dtype=torch.bfloat16),
        "return_dict": False,
    }


def _memcpy_seconds(model) -> float:
    """A plain copy of the model's bytes, tensor by tensor, into fresh memory."""
    import torch

    tensors = list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    start = time.perf_counter()
    out = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += n
    seconds = time.perf_counter() - start
    del out
    return seconds


def _scenario(name: str, folder: str, config: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    """One scenario, measured in this (fresh) process: host bytes above the process's RSS before
    the model existed, the fake device's memory (host memory here, not on a GPU) taken out."""
    import torch

    torch.set_num_threads(1)
    import tqdm.auto  # noqa: F401 - everything the scenarios import, imported before the baseline
    from diffusers import WanTransformer3DModel  # noqa: F401

    import offload_core
    from offload_core.hostmem.machine import return_free_memory

    backend = offload_core.get_backend("fake", chaos=False, sanitize=False)  # measured, not checked
    allocate = backend.empty_device
    # fake device memory is host memory, taken out of every figure below: touched when allocated,
    # as a device's memory is there once allocated, so that taking it out is exact
    backend.empty_device = lambda size, dtype=torch.uint8: allocate(size, dtype).zero_()
    base = rss()
    out: dict[str, Any] = {}

    def host(peak: int, device: int | None = None) -> int:
        return peak - base - (backend.memory_allocated() if device is None else device)

    if name == "cycles":
        model = _built_model(folder)
        return_free_memory()
        out["built"] = host(rss())
        memcpy, enables = [], []
        for cycle in (1, 2):
            memcpy.append(_memcpy_seconds(model))
            return_free_memory()
            with Peak() as enable:
                handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
            enables.append(enable.seconds)
            out[f"enable_{cycle}"] = host(enable.peak)
            device = backend.memory_allocated()
            with Peak() as disable:
                handle.disable()
            out[f"disable_{cycle}"] = host(disable.peak, device)
            out[f"after_cycle_{cycle}"] = host(rss())
        out["block"] = max(u.nbytes for u in handle.parts[0].units)
        out["memcpy_s"] = min(memcpy)
        out["enable_s"] = min(enables)
        out["memcpy_samples_s"], out["enable_samples_s"] = memcpy, enables
        return out
    options: dict[str, Any] = {}
    if name == "pinned_half":
        options["pinned_memory"] = model_bytes // 2
    elif name == "disk_quarter":
        options["host_memory"] = model_bytes // 4
    with Peak() as load:
        handle = offload_core.from_pretrained(folder, torch_dtype=torch.bfloat16, enable_layerwise_offload=True,
                                              backend=backend, **options)
    out["load"] = host(load.peak)
    out["load_s"] = load.seconds
    out["after_load"] = host(rss())
    stats = handle.stats()
    out.update({k: stats[k] for k in ("pinned_host_bytes", "pageable_host_bytes", "disk_bytes", "bounce_bytes")})
    out["block"] = max(u.nbytes for u in handle.parts[0].units)
    if name in ("pinned_half", "disk_quarter"):
        with Peak() as step, torch.no_grad():
            handle.target(**_inputs(config))
        out["forward"] = host(step.peak)
        out["forward_s"] = step.seconds
        out["staged_bytes"] = handle.stats()["staged_bytes"]
    device = backend.memory_allocated()
    with Peak() as disable:
        handle.disable()
    out["disable"] = host(disable.peak, device)
    return out


# -- the parent --------------------------------------------------------------------------------
SCENARIOS = ("cycles", "from_pretrained", "pinned_half", "disk_quarter")


def run_scenario(name: str, folder: str, config: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    """Run scenario ``name`` on the checkpoint in ``folder`` in a fresh Python process."""
    command = [sys.executable, "-m", "offload_core.bench.hostmem", name, folder, str(model_bytes), json.dumps(config)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"host-memory scenario {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_memory(quick: bool = False) -> dict[str, Any]:
    """Write the checkpoint, run every scenario in its own process, and report each figure as
    host bytes / model bytes, the issue's bounds beside them, and seconds per GB."""
    from .timing import ratio  # imports torch: not in the scenarios' processes before they measure

    config = QUICK if quick else WAN_1_3B
    with tempfile.TemporaryDirectory(prefix="offload-core-bench-") as folder:
        model_bytes = write_checkpoint(folder, config)
        raw = {name: run_scenario(name, folder, config, model_bytes) for name in SCENARIOS}
    cycles, load, half, disk = raw["cycles"], raw["from_pretrained"], raw["pinned_half"], raw["disk_quarter"]
    block = load["block"]
    r = lambda n: n / model_bytes  # noqa: E731
    per_gb = model_bytes / GB
    enable_over_memcpy, enable_spread = ratio(cycles["enable_samples_s"], cycles["memcpy_samples_s"])
    return {
        "model": "Wan2.1-1.3B transformer, bf16" if not quick else "small Wan transformer, bf16",
        "model_bytes": model_bytes,
        "block_bytes": block,
        "enable_built": r(cycles["enable_1"]),
        "disable": r(cycles["disable_1"]),
        "after_first_cycle": r(cycles["after_cycle_1"]),
        "second_enable": r(cycles["enable_2"]),
        "after_second_cycle": r(cycles["after_cycle_2"]),
        "second_cycle_over_first": cycles["after_cycle_2"] / max(cycles["after_cycle_1"], 1),
        "load": r(load["load"]),
        "load_over_bound": load["load"] / (1.15 * model_bytes + SLACK),
        "load_disable": r(load["disable"]),
        "pinned_half_load": r(half["load"]),
        "pinned_half_forward": r(half["forward"]),
        "pinned_half_pinned_bytes": half["pinned_host_bytes"],
        "disk_quarter_load": r(disk["load"]),
        "disk_quarter_forward": r(disk["forward"]),
        "disk_over_bound": max(disk["load"], disk["forward"]) / (model_bytes // 4 + block + SLACK),
        "disk_bytes": disk["disk_bytes"],
        "enable_s_per_gb": cycles["enable_s"] / per_gb,
        "memcpy_s_per_gb": cycles["memcpy_s"] / per_gb,
        "enable_over_memcpy": enable_over_memcpy,
        "load_s_per_gb": load["load_s"] / per_gb,
        "pinned_half_forward_s": half["forward_s"],
        "disk_quarter_forward_s": disk["forward_s"],
        "raw": raw,
        "spread": {"enable_over_memcpy": enable_spread},
    }


def main(argv: list[str]) -> None:
    name, folder, model_bytes, config = argv
    logging.disable(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")
    config = json.loads(config)
    config["patch_size"] = tuple(config["patch_size"])
    print(json.dumps(_scenario(name, folder, config, int(model_bytes))))


if __name__ == "__main__":
    main(sys.argv[1:])
