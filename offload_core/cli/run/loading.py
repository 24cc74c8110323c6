"""``offload-core run``'s pipelines: building an embedded one, or loading a local diffusers folder.

A folder is checked before it is loaded, as far as reading its metadata allows: ``model_index.json``
must name a diffusers pipeline class and importable component classes, and every
``.safetensors`` file must have a readable header that covers the file. What still fails inside
``from_pretrained`` is a folder that cannot be loaded, and reported as bad input too: the user
named it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ...tiny import as_tensor
from ..common import UsageError
from .arguments import CALL_PARAMETERS, DEFAULT_PIPELINE, DEMO_STEPS, embedded

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PROMPT = "a cat sitting on a bench"
#: fields of a diffusers pipeline output that hold the pixels, in the order they are looked for
OUTPUT_FIELDS = ("images", "frames", "videos", "video")


@dataclasses.dataclass
class Target:
    """A loaded pipeline and how to make the one seeded call on it."""

    label: str
    pipe: Any
    call: Callable[[dict[str, Any], int], torch.Tensor]  # (overrides, seed) -> output tensor
    defaults: dict[str, Any]  # call arguments the pipeline runs with unless overridden


def pipeline_class(args: argparse.Namespace) -> type:
    """The pipeline class, known before anything is built or loaded; a folder is checked on the way."""
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(missing_model(args.model))
    import diffusers

    if args.model is None:
        return getattr(diffusers, embedded()[args.pipeline or DEFAULT_PIPELINE].cls_name)
    folder = Path(args.model)
    index_file = folder / "model_index.json"
    if not folder.is_dir() or not index_file.is_file():
        raise UsageError(f"--model {args.model!r} is not a diffusers pipeline folder (no model_index.json)")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        name = index["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--model {args.model!r}: unreadable model_index.json ({type(exc).__name__}: {exc})") from None
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise UsageError(
            f"--model {args.model!r}: model_index.json names {name!r}, which is not a diffusers pipeline class "
            f"(diffusers {diffusers.__version__})"
        )
    _check_components(args.model, index)
    _check_safetensors(args.model, folder)
    return cls


def missing_model(model: str) -> str:
    """The message for a ``--model`` that names no file: it may be a Hub id, and nothing is
    downloaded, so say how to get one."""
    looks_like_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    repo, folder = (model, Path(model).name) if looks_like_id else ("ID", "DIR")
    return (
        f"--model {model!r}: no such file or directory; --model takes a local diffusers folder and downloads "
        f"nothing. For a Hugging Face Hub model: huggingface-cli download {repo} --local-dir {folder}, "
        f"then --model {folder}"
    )


def _check_components(model: str, index: dict[str, Any]) -> None:
    """Each ``"name": [library, class]`` entry names a class its library has."""
    for component, entry in index.items():
        if component.startswith("_") or not (isinstance(entry, list) and len(entry) == 2):
            continue
        library, cls_name = entry
        if library is None or cls_name is None:
            continue  # an optional component left out
        try:
            found = hasattr(importlib.import_module(str(library)), str(cls_name))
        except ImportError:
            found = False
        if not found:
            raise UsageError(
                f"--model {model!r}: model_index.json gives component {component!r} the class "
                f"{library}.{cls_name}, which cannot be imported"
            )


def _check_safetensors(model: str, folder: Path) -> None:
    """Every weight file's header parses and covers the file (reads headers only, maps no data)."""
    from safetensors import safe_open

    for path in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - any failure to parse is a corrupt file
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise UsageError(f"--model {model!r}: {str(path.relative_to(folder))!r} is not a valid safetensors file "
                             f"({reason})") from None


def load(args: argparse.Namespace, offloaded: bool = True) -> Target:
    """Build the embedded pipeline or load the folder ``--model`` names: to be ``offloaded``, as
    ``offload_core.from_pretrained`` loads it (each model on the meta device with its checkpoint's
    slices, which enable reads straight into their homes, the rest in RAM), else by diffusers;
    either way in the dtype each checkpoint is stored in."""
    return _build_tiny(args) if args.model is None else _load_model(args, offloaded)


def _build_tiny(args: argparse.Namespace) -> Target:
    from ...tiny import build_pipeline

    name = args.pipeline or DEFAULT_PIPELINE
    logger.info("building the tiny pipeline %r", name)
    tiny = build_pipeline(name)
    settings = {"num_inference_steps": DEMO_STEPS} if name == DEFAULT_PIPELINE else {}
    return Target(name, tiny.pipe, lambda overrides, seed: tiny.run(seed, **{**settings, **overrides}),
                  {**tiny.call_kwargs, **settings})


def _load_model(args: argparse.Namespace, offloaded: bool) -> Target:
    from diffusers import DiffusionPipeline

    from ...pretrained.load import checkpoint_dtype, load

    logger.info("loading %s", args.model)
    try:
        if offloaded:
            pipe = load(args.model, torch_dtype="auto")
        else:
            dtypes = {p.name: d for p in Path(args.model).iterdir() if p.is_dir() and (d := checkpoint_dtype(p))}
            pipe = DiffusionPipeline.from_pretrained(args.model, local_files_only=True, torch_dtype=dtypes or None)
    except Exception as exc:  # noqa: BLE001 - the folder was checked; what is left is a folder that cannot load
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise UsageError(f"--model {args.model!r} cannot be loaded: {what}") from exc
    params = inspect.signature(type(pipe).__call__).parameters
    defaults = {
        name: p.default
        for name, p in params.items()
        if name in CALL_PARAMETERS.values() and p.default is not inspect.Parameter.empty
    }
    fixed: dict[str, Any] = {"output_type": "pt"} if "output_type" in params else {}
    if "prompt" in params:
        fixed["prompt"] = DEFAULT_MODEL_PROMPT

    def call(overrides: dict[str, Any], seed: int) -> torch.Tensor:
        generator = torch.Generator("cpu").manual_seed(seed)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)  # for pipelines that also draw from the global RNG
            output = pipe(**{**fixed, **overrides}, generator=generator)
        return as_tensor(_pixels(output))

    return Target(str(args.model), pipe, call, {**defaults, **fixed})


def _pixels(output: Any) -> Any:
    for name in OUTPUT_FIELDS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(f"no image or video in the pipeline output ({type(output).__name__})")


def size_multiple(pipe: Any) -> int | None:
    """The multiple a pipeline needs its height and width to be, where it says so: its VAE's
    downscale factor, doubled for pipelines that pack latents 2x2 (FLUX and its kin). Such
    pipelines round other sizes down with a logged warning instead of refusing them."""
    factor = getattr(pipe, "vae_scale_factor", None)
    if not isinstance(factor, int) or factor < 1:
        return None
    return factor * 2 if hasattr(type(pipe), "_pack_latents") else factor


def check_size(pipe: Any, overrides: dict[str, Any]) -> None:
    """A requested size the pipeline would silently round is bad input, found before the run."""
    multiple = size_multiple(pipe)
    if multiple is None:
        return
    for flag in ("height", "width"):
        value = overrides.get(flag)
        if value is not None and value % multiple:
            raise UsageError(
                f"--{flag} {value}: {type(pipe).__name__} needs a multiple of {multiple} "
                f"(it would round {value} to {value // multiple * multiple})"
            )
