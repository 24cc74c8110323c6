"""Real-scale benchmark (``offload-core bench --only realscale``): checkpoints bigger than RAM,
loaded with ``from_pretrained`` inside a host budget, against a reference that streams its blocks
from the checkpoint by hand.

The models are the real configs, with random bf16 weights: the Wan2.2-T2V-A14B transformer (a
diffusers ``WanTransformer3DModel``, 28.6 GB: more than a 24 GiB machine's RAM) and the UMT5-XXL
text encoder (a transformers ``UMT5EncoderModel``, 11.4 GB). Each is written once into a cache
folder as its library's ``save_pretrained`` lays it out (config.json, shards, index), tensor by
tensor from a fixed seed (:func:`~offload_core.bench.hostmem.write_weights`), and reused while
its marker file names the same config and :data:`CACHE_VERSION`.

Per model, two fresh processes read the checkpoint with the page cache emptied of it first
(``posix_fadvise(DONTNEED)`` on its files, after they were synced): one loads it with
``offload_core.from_pretrained(..., enable_layerwise_offload=True, host_memory="6GiB")`` on the
fake backend and runs one forward at a tiny input, the other builds the model on the meta device,
loads its non-block weights with safetensors, and materialises each block from the checkpoint
just before it runs, freeing it after (no offload-core code). Each reports the kernel's RSS
high-water mark, its load and forward times and the bytes it read from disk; the outputs must be
equal bit for bit. The fake device's memory is host memory here and is inside the peak.

``--dry-run`` is the same code at tiny configs of the same classes, with ``host_memory`` the same
share of each model, in a temporary cache: what CI runs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)

GiB = 2**30
GB = 1e9
#: bump when the writer or the layout changes: older caches are rewritten
CACHE_VERSION = 1
MARKER = ".offload-core-realscale.json"
HOST_MEMORY = 6 * GiB
#: the issue's allowance above host_memory: interpreter, torch, the fake device, one block
SLACK = 2.5 * GiB
#: disk kept free beyond the checkpoints (outputs, a spill folder's index, the file system's own)
DISK_MARGIN = 1 * GiB

#: Wan2.2-T2V-A14B's transformer (each of its two experts): diffusers' WanTransformer3DModel
WAN_A14B: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
WAN_TINY: dict[str, Any] = dict(WAN_A14B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16,
                                ffn_dim=64, num_layers=6, rope_max_seq_len=64)
#: UMT5-XXL's encoder (Wan's text encoder): transformers' UMT5EncoderModel
UMT5_XXL: dict[str, Any] = dict(
    d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=256384,
    feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
)
UMT5_TINY: dict[str, Any] = dict(UMT5_XXL, d_model=32, d_ff=64, num_layers=6, num_heads=4, d_kv=8, vocab_size=512)


@dataclasses.dataclass(frozen=True)
class Model:
    """One benchmarked model: its class, configs, block list and checkpoint layout."""

    key: str
    label: str
    library: str  # "diffusers" or "transformers"
    class_name: str
    config: dict[str, Any]
    tiny: dict[str, Any]
    blocks: str  # the attribute path of the block list the reference streams
    weights_name: str
    max_shard_size: int  # as its checkpoints are published: several shards

    def config_of(self, dry_run: bool) -> dict[str, Any]:
        return self.tiny if dry_run else self.config

    def folder(self, cache: str, dry_run: bool) -> str:
        return os.path.join(cache, self.key + ("-tiny" if dry_run else ""))

    def model_class(self) -> type:
        import importlib

        return getattr(importlib.import_module(self.library), self.class_name)

    def on_meta(self, config: dict[str, Any]) -> Any:
        """The model, every tensor on the meta device: names and shapes, nothing allocated."""
        import torch

        cls = self.model_class()
        with torch.device("meta"):
            return cls(**config) if self.library == "diffusers" else cls(cls.config_class(**config))

    def inputs(self, config: dict[str, Any]) -> dict[str, Any]:
        """A tiny input, the same in every process (seeded): a 1-frame 64x64 latent (16 tokens) and
        8 text tokens, so that the forward's time is the blocks' reads, not their compute."""
        import torch

        g = torch.Generator().manual_seed(0)
        if self.library == "diffusers":
            return {
                "hidden_states": torch.randn(1, config["in_channels"], 1, 8, 8, generator=g).to(torch.bfloat16),
                "timestep": torch.tensor([500]),
                "encoder_hidden_states": torch.randn(1, 8, config["text_dim"], generator=g).to(torch.bfloat16),
                "return_dict": False,
            }
        return {"input_ids": torch.randint(config["vocab_size"], (1, 8), generator=g)}

    @staticmethod
    def output(result: Any) -> Any:
        return result[0] if isinstance(result, tuple) else result.last_hidden_state


MODELS = (
    Model("wan2.2-t2v-a14b-transformer", "Wan2.2-T2V-A14B transformer", "diffusers", "WanTransformer3DModel",
          WAN_A14B, WAN_TINY, "blocks", "diffusion_pytorch_model.safetensors", 10 * 10**9),
    Model("umt5-xxl-encoder", "UMT5-XXL encoder", "transformers", "UMT5EncoderModel",
          UMT5_XXL, UMT5_TINY, "encoder.block", "model.safetensors", 2 * 10**9),
)
BY_NAME = {"wan": MODELS[0], "umt5": MODELS[1]}


class NotEnoughDisk(RuntimeError):
    """The cache folder's file system has too little free space for the checkpoints."""


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload-core", "realscale")


# -- the cache ---------------------------------------------------------------------------------
def checkpoint_bytes(model: Model, config: dict[str, Any]) -> int:
    """The bf16 bytes of ``model``'s checkpoint (tied tensors once)."""
    built = model.on_meta(config)
    tensors = {id(t): t for t in built.state_dict(keep_vars=True).values()}
    return sum(t.numel() * 2 for t in tensors.values())


def _marker(model: Model, config: dict[str, Any], max_shard_size: int) -> dict[str, Any]:
    return {"version": CACHE_VERSION, "library": model.library, "class": model.class_name,
            "config": json.loads(json.dumps(config)), "max_shard_size": max_shard_size, "seed": 0}


def _cached(folder: str, marker: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return json.load(f) == marker
    except (OSError, ValueError):
        return False


def _free_bytes(path: str) -> int:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def prepare(models: list[Model], cache: str, dry_run: bool) -> dict[str, dict[str, Any]]:
    """Each model's checkpoint folder in ``cache``, written unless its marker matches; before
    writing anything, a :class:`NotEnoughDisk` naming the shortfall when the disk lacks room."""
    checkpoints = {}
    for model in models:
        config = model.config_of(dry_run)
        nbytes = checkpoint_bytes(model, config)
        # tiny checkpoints are still split (into about three shards): the same layout as real ones
        shard = max(nbytes // 3, 1) if dry_run else model.max_shard_size
        marker = _marker(model, config, shard)
        folder = model.folder(cache, dry_run)
        checkpoints[model.key] = {"folder": folder, "bytes": nbytes, "marker": marker, "cached": _cached(folder, marker)}
    needed = sum(p["bytes"] for p in checkpoints.values() if not p["cached"])
    if needed:
        free = _free_bytes(cache)
        if free < needed + DISK_MARGIN:
            missing = needed + DISK_MARGIN - free
            raise NotEnoughDisk(
                f"realscale needs {(needed + DISK_MARGIN) / GB:.1f} GB free in {cache} for its checkpoints "
                f"({needed / GB:.1f} GB, and {DISK_MARGIN / GB:.1f} GB to spare); it has {free / GB:.1f} GB: "
                f"{missing / GB:.1f} GB missing (free space, or choose another folder with --cache-dir)")
    for model in models:
        facts = checkpoints[model.key]
        if facts["cached"]:
            logger.info("realscale: reusing %s (%.1f GB)", facts["folder"], facts["bytes"] / GB)
            continue
        _write(model, facts["folder"], facts["marker"])
    return checkpoints


def _write(model: Model, folder: str, marker: dict[str, Any]) -> None:
    from .hostmem import write_weights

    shutil.rmtree(folder, ignore_errors=True)  # a partial or outdated write
    os.makedirs(folder)
    built = model.on_meta(marker["config"])
    if model.library == "diffusers":
        built.save_config(folder)
    else:  # as transformers' save_pretrained records them
        built.config.architectures = [model.class_name]
        built.config.dtype = "bfloat16"
        built.config.save_pretrained(folder)
    start = time.perf_counter()
    nbytes = write_weights(folder, built, model.weights_name, marker["max_shard_size"])
    logger.info("realscale: wrote %s, %.1f GB in %.0f s", folder, nbytes / GB, time.perf_counter() - start)
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:  # last: a complete checkpoint
        json.dump(marker, f)


def clean(cache: str) -> list[str]:
    """Remove the checkpoints this benchmark wrote into ``cache`` (only its own folders), and
    ``cache`` itself when that leaves it empty: the folders removed."""
    removed = []
    for model in MODELS:
        for dry_run in (False, True):
            folder = model.folder(cache, dry_run)
            if os.path.isdir(folder):
                shutil.rmtree(folder)
                removed.append(folder)
    if os.path.isdir(cache) and not os.listdir(cache):
        os.rmdir(cache)
    return removed


def _drop_from_page_cache(folder: str) -> bool:
    """Ask the kernel to forget the folder's cached pages, so that the next reader reads the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


# -- measuring, in the child processes -----------------------------------------------------------
def _disk_read_bytes() -> int:
    """Bytes this process has had read from storage (not from the page cache)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return -1


def _measured(load: Any, forward: Any, io: list[int]) -> dict[str, Any]:
    return {"peak_rss": max(load.peak, forward.peak), "load_peak_rss": load.peak, "forward_peak_rss": forward.peak,
            "load_s": load.seconds, "forward_s": forward.seconds,
            "load_disk_read_bytes": io[1] - io[0], "forward_disk_read_bytes": io[2] - io[1]}


def offloaded(model: Model, folder: str, config: dict[str, Any], host_memory: int, out: str) -> dict[str, Any]:
    """Load with from_pretrained inside ``host_memory`` and run one forward; the output to ``out``."""
    import torch

    import offload_core
    from .hostmem import Peak

    backend = offload_core.get_backend("fake", chaos=False, sanitize=False)  # measured, not checked
    inputs = model.inputs(config)
    options: dict[str, Any] = dict(torch_dtype=torch.bfloat16, enable_layerwise_offload=True,
                                   host_memory=host_memory, backend=backend)
    result: dict[str, Any] = {"refused": None}
    io = [_disk_read_bytes()]
    with Peak() as load:
        try:
            handle = offload_core.from_pretrained(folder, **options)
        except offload_core.OffloadConfigError as exc:
            if "offload_folder" not in str(exc):
                raise
            # a model from_pretrained handed to its library: only a spill copy keeps it in budget
            result["refused"] = str(exc)
        if result["refused"] is not None:  # outside the handler: the refused model is freed first
            gc.collect()
            spill = tempfile.mkdtemp(prefix="spill-", dir=os.path.dirname(out))
            handle = offload_core.from_pretrained(folder, offload_folder=spill, **options)
    io.append(_disk_read_bytes())
    with Peak() as forward, torch.no_grad():
        output = model.output(handle.target(**inputs))
    io.append(_disk_read_bytes())
    torch.save(output, out)
    stats = handle.stats()
    result.update(_measured(load, forward, io))
    result.update({key: stats[key] for key in ("disk_bytes", "host_bytes", "pinned_host_bytes", "pageable_host_bytes",
                                               "device_peak_bytes", "disk_read_bytes", "disk_read_seconds")
                   if key in stats})
    result["block_bytes"] = max(u.nbytes for u in handle.parts[0].units)
    return result


def _fp32_rule(model: Model, cls: type, dtype: Any) -> Any:
    """Which checkpoint keys the library keeps in float32 when loading at ``dtype``."""
    import torch

    if model.library == "diffusers":
        keep = cls._keep_in_fp32_modules or []
    else:  # transformers keeps its non-strict list for float16 only
        keep = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            keep += cls._keep_in_fp32_modules or []
    return lambda key: any(m in key.split(".") for m in keep)


class _Checkpoint:
    """The checkpoint's tensors by name, each read with safetensors from its shard, cast as the
    library casts it at load time."""

    def __init__(self, folder: str, weights_name: str, to_dtype: Any) -> None:
        from safetensors import safe_open

        index = os.path.join(folder, weights_name + ".index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.files = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            path = os.path.join(folder, weights_name)
            with safe_open(path, "pt") as f:
                self.files = {k: path for k in f.keys()}
        self.to_dtype = to_dtype

    def read(self, keys: list[str]) -> dict[str, Any]:
        from safetensors import safe_open

        out: dict[str, Any] = {}
        for path in sorted({self.files[k] for k in keys}):
            with safe_open(path, "pt") as f:  # opened per block: no mapping outlives its reads
                for key in keys:
                    if self.files[key] == path:
                        t = f.get_tensor(key)
                        out[key] = t.to(self.to_dtype(key, t))
        return out


def reference(model: Model, folder: str, config: dict[str, Any], out: str) -> dict[str, Any]:
    """The same forward with no offload-core code: the model built on the meta device (buffers
    computed), its non-block weights read with safetensors, each block read from the checkpoint
    just before it runs and dropped after it."""
    import torch
    from accelerate import init_empty_weights
    from torch import nn

    from .hostmem import Peak

    dtype = torch.bfloat16
    cls = model.model_class()
    keep_fp32 = _fp32_rule(model, cls, dtype)
    cast = lambda key, t: (torch.float32 if keep_fp32(key) else dtype) if t.is_floating_point() else t.dtype  # noqa: E731
    checkpoint = _Checkpoint(folder, model.weights_name, cast)
    inputs = model.inputs(config)
    io = [_disk_read_bytes()]
    with Peak() as load:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # both libraries construct at the load dtype
        try:
            with init_empty_weights():
                built = cls.from_config(cls.load_config(folder)) if model.library == "diffusers" \
                    else cls(cls.config_class.from_pretrained(folder))
        finally:
            torch.set_default_dtype(previous)
        built.eval()
        blocks = built.get_submodule(model.blocks)
        prefix = model.blocks + "."
        keys = [k for k in built.state_dict() if not k.startswith(prefix)]
        tied = getattr(built, "_tied_weights_keys", None) or {}
        present = [k for k in keys if k in checkpoint.files]
        weights = checkpoint.read(present)
        for key in keys:
            if key not in weights:
                weights[key] = weights[tied[key]]  # a tied tensor, saved once
        built.load_state_dict(weights, assign=True, strict=False)
        del weights

        def materialise(block: nn.Module, args: Any) -> None:
            own = f"{prefix}{next(i for i, b in enumerate(blocks) if b is block)}."
            tensors = checkpoint.read([k for k in checkpoint.files if k.startswith(own)])
            block.load_state_dict({k[len(own):]: t for k, t in tensors.items()}, assign=True, strict=True)

        def drop(block: nn.Module, args: Any, output: Any) -> None:
            for module in block.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)

        for block in blocks:
            block.register_forward_pre_hook(materialise)
            block.register_forward_hook(drop)
    io.append(_disk_read_bytes())
    with Peak() as forward, torch.no_grad():
        output = model.output(built(**inputs))
    io.append(_disk_read_bytes())
    torch.save(output, out)
    return _measured(load, forward, io)


def child(argv: list[str]) -> None:
    """``python -m offload_core.bench.realscale ROLE MODEL FOLDER DRY_RUN HOST_MEMORY OUT``: one
    measurement in this fresh process, its figures printed as the last line of JSON."""
    role, key, folder, dry_run, host_memory, out = argv
    logging.disable(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")
    model = next(m for m in MODELS if m.key == key)
    model.model_class()  # its library imported before anything is measured
    config = model.config_of(dry_run == "1")
    if role == "offloaded":
        figures = offloaded(model, folder, config, int(host_memory), out)
    else:
        figures = reference(model, folder, config, out)
    print(json.dumps(figures))


# -- the parent --------------------------------------------------------------------------------
ROLES = ("offloaded", "reference")


@dataclasses.dataclass
class _Child:
    """One measurement in its own process: the model, the role, and its output's file."""

    model: Model
    role: str
    folder: str
    dry_run: bool
    host_memory: int
    out: str
    process: subprocess.Popen | None = None
    cold: bool = False
    figures: dict[str, Any] | None = None

    def start(self) -> None:
        self.cold = _drop_from_page_cache(self.folder)
        logger.info("realscale: %s, %s", self.model.label, self.role)
        command = [sys.executable, "-m", "offload_core.bench.realscale", self.role, self.model.key, self.folder,
                   "1" if self.dry_run else "0", str(self.host_memory), self.out]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self) -> dict[str, Any]:
        """Its figures, starting it first if it is not running yet."""
        if self.process is None:
            self.start()
        assert self.process is not None
        stdout, stderr = self.process.communicate()
        if self.process.returncode != 0:
            raise RuntimeError(f"realscale: {self.model.label}, {self.role}, failed (exit "
                               f"{self.process.returncode}):\n{stderr[-4000:]}")
        self.figures = json.loads(stdout.strip().splitlines()[-1])
        self.figures["page_cache_dropped"] = self.cold
        return self.figures


def _host_memory(model: Model, nbytes: int, dry_run: bool) -> int:
    """6 GiB; in a dry run, the same share of the tiny model as 6 GiB is of the real one."""
    if not dry_run:
        return HOST_MEMORY
    return max(int(nbytes * HOST_MEMORY / checkpoint_bytes(model, model.config)), 1)


def _compare(facts: dict[str, Any], ours: _Child, theirs: _Child) -> dict[str, Any]:
    import torch

    a, b = torch.load(ours.out), torch.load(theirs.out)
    mine, reference = ours.figures or {}, theirs.figures or {}
    read = mine.get("disk_read_bytes", mine["forward_disk_read_bytes"])
    seconds = mine.get("disk_read_seconds", mine["forward_s"])
    bound = ours.host_memory + SLACK
    return {
        "model": ours.model.label,
        "folder": facts["folder"],
        "reused_cache": facts["cached"],
        "checkpoint_bytes": facts["bytes"],
        "host_memory": ours.host_memory,
        "peak_rss": mine["peak_rss"],
        "peak_rss_over_bound": mine["peak_rss"] / bound,
        # on the fake backend the device's memory is host memory too: taken out (its peak), what
        # a machine with a GPU holds on its host, as the host-memory section counts it
        "host_peak_rss": mine["peak_rss"] - mine.get("device_peak_bytes", 0),
        "host_peak_rss_over_bound": (mine["peak_rss"] - mine.get("device_peak_bytes", 0)) / bound,
        "load_s": mine["load_s"],
        "forward_s": mine["forward_s"],
        "disk_read_bytes": read,
        "disk_read_mb_per_s": read / seconds / 1e6 if read > 0 and seconds > 0 else 0.0,
        "outputs_equal": bool(torch.equal(a, b)),
        "differing_elements": int((a != b).sum()) if a.shape == b.shape else a.numel(),
        "output_finite": bool(torch.isfinite(a.float()).all()),
        "reference_peak_rss": reference["peak_rss"],
        "reference_peak_rss_over_bound": reference["peak_rss"] / bound,
        "reference_load_s": reference["load_s"],
        "reference_forward_s": reference["forward_s"],
        "reference_disk_read_bytes": reference["forward_disk_read_bytes"],
        "offloaded": mine,
        "reference": reference,
    }


def realscale(dry_run: bool = False, cache_dir: str | None = None, models: list[str] | None = None) -> dict[str, Any]:
    """Write (or reuse) the checkpoints and measure each model against its reference. ``models``:
    names of :data:`BY_NAME` (default: all); ``cache_dir``: where the checkpoints live (default
    :func:`default_cache_dir`; for a dry run, a temporary folder)."""
    chosen = [BY_NAME[name] for name in models] if models else list(MODELS)
    with tempfile.TemporaryDirectory(prefix="offload-core-realscale-") as work:
        cache = cache_dir or (os.path.join(work, "cache") if dry_run else default_cache_dir())
        checkpoints = prepare(chosen, cache, dry_run)
        pairs = {}
        for name, model in BY_NAME.items():
            if model in chosen:
                facts = checkpoints[model.key]
                host_memory = _host_memory(model, facts["bytes"], dry_run)
                pairs[name] = [_Child(model, role, facts["folder"], dry_run, host_memory,
                                      os.path.join(work, f"{model.key}-{role}.pt")) for role in ROLES]
        children = [child for pair in pairs.values() for child in pair]
        if dry_run:  # tiny: all at once, to finish sooner on a CI machine's cores
            for child in children:
                child.start()
        for child in children:  # at real scale one at a time: each has the RAM and the disk to itself
            child.wait()
        results: dict[str, Any] = {"cache_dir": cache, "dry_run": dry_run}
        for name, (ours, theirs) in pairs.items():
            results[name] = _compare(checkpoints[ours.model.key], ours, theirs)
    return results


if __name__ == "__main__":
    child(sys.argv[1:])
