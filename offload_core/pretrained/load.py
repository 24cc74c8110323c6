"""``offload_core.from_pretrained``: a local diffusers folder loaded straight into offloaded homes.

``diffusers``' own ``from_pretrained`` followed by ``enable_offload`` holds the model twice at the
peak: the loaded tensors (file-backed, mapped until the last of them dies) and the packed homes.
Here every diffusers and ``transformers`` model of the folder (text encoders included) is built
without allocating its parameters (on the meta device), each checkpoint tensor is attached to its
meta parameter as the slice of the file it lives in (``weights.checkpoint.attach_slices``), and
``enable_offload`` then reads each slice straight into the unit's pinned or pageable home, or
leaves it on disk for the blocks beyond ``host_memory``. Everything else (schedulers, tokenizers,
models without safetensors weights) is loaded by diffusers as usual and packed as
``enable_offload`` packs any model.

Built diffusers models follow diffusers' loading rules, so that the result equals diffusers'
``from_pretrained``: the default dtype during construction, ``torch_dtype`` for floating
checkpoint tensors except the class's ``_keep_in_fp32_modules``, the model's own dtype otherwise,
initialisers skipped, key fixes of single-file checkpoints, ``eval()`` mode. A checkpoint
lacking a weight of the model, or holding one of another shape, is refused (diffusers cannot load
it either: it leaves a missing weight on the meta device and refuses a shape), except under a
quantization config, where diffusers' quantizer decides; a model diffusers loads and leaves with
a weight on the meta device is refused too.

Nothing from the folder is trusted before it is checked: every safetensors header (see
:mod:`offload_core.hostmem.safetensors_header`), every path the folder names (:mod:`.folder`), every
class a config names; each refusal is a :class:`~offload_core.base.errors.CheckpointError` raised
before anything is built or enabled.
``transformers`` models follow transformers' rules by running its own ``from_pretrained`` with
only the reading of the checkpoint replaced (:mod:`.encoders`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..api import enable_offload, given_options, resolve_config
from ..common.config import OffloadConfig
from ..device.backend import DeviceBackend
from ..enabling.enable import enable
from ..base.errors import CheckpointError, OffloadConfigError
from ..handle import OffloadHandle
from ..hostmem.machine import auto_host_budget
from .folder import ModelFolder
from ..discovery.pipelines import inventory
from ..hostmem.disk import read_index
from ..hostmem.safetensors_header import read_header
from ..weights.checkpoint import attach_slices
from ..weights.owners import SOURCE_ATTRIBUTE
from ..weights.slices import FileSlice

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMERS_WEIGHTS_NAME = "model.safetensors"
TRANSFORMERS_INDEX_NAME = "model.safetensors.index.json"


def _with_offload_options(func: Callable[..., OffloadHandle]) -> Callable[..., OffloadHandle]:
    """``func``'s signature with :func:`enable_offload`'s options (its keyword-only parameters)
    before its ``**`` parameter: one list of options, which ``help()`` and ``inspect.signature``
    show for both functions."""
    *own, rest = inspect.signature(func).parameters.values()
    options = [p for p in inspect.signature(enable_offload).parameters.values() if p.kind is p.KEYWORD_ONLY]
    func.__signature__ = inspect.signature(func).replace(parameters=[*own, *options, rest])
    return func


@_with_offload_options
def from_pretrained(
    path: str | os.PathLike,
    *,
    torch_dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    **replaced_components: Any,
) -> OffloadHandle:
    """Load the diffusers pipeline (a folder with ``model_index.json``) or single diffusers or
    transformers model (a folder with ``config.json``) at ``path`` and turn offloading on, weights
    read from the checkpoint straight into their offloaded homes. The options are
    :func:`enable_offload`'s (the signature lists them); ``handle.target`` is the loaded pipeline
    or model.

    ``torch_dtype`` is diffusers': a ``torch.dtype``, or for a pipeline a dict of component name
    (or ``"default"``) to dtype; or ``"auto"``, each model in the dtype its checkpoint is stored in. For a pipeline, ``replaced_components``: a keyword naming one of
    its components replaces that component, as in diffusers (``text_encoder=None`` loads no text
    encoder: pass ``prompt_embeds`` to the pipeline); any other name is refused. With
    ``host_memory`` left to "auto", weights may use up to 90 % of the memory available when
    loading starts; the blocks beyond it stay on disk and are read from the checkpoint when they
    run. A checkpoint that breaks the safetensors format's rules, names a file outside the folder
    or a class that is not a model is refused with a :class:`~offload_core.CheckpointError`. See
    ``docs/bigger-than-ram.md``.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    passed = replaced_components  # the options too: the signature names them, the call brings them here
    options = given_options({**defaults, **passed}, {k: v for k, v in passed.items() if k not in defaults})
    folder = ModelFolder(path)
    index = _model_index(folder)
    replaced = {k: options.pop(k) for k in list(options) if k not in defaults and index is not None and k in index}
    config = resolve_config(None, options)
    if torch_dtype is not None and torch_dtype != "auto" and not isinstance(torch_dtype, (torch.dtype, dict)):
        raise OffloadConfigError(f"torch_dtype must be a torch.dtype, 'auto' (or, for a pipeline, a dict), got "
                                 f"{torch_dtype!r}")
    kind = "pipeline" if index is not None else "module"
    if kind == "module" and not folder.has("config.json"):
        raise FileNotFoundError(
            f"{folder.path} is not a local diffusers folder: it has neither model_index.json (a pipeline) nor "
            "config.json (a model)"
        )
    if kind == "module" and isinstance(torch_dtype, dict):
        raise OffloadConfigError("torch_dtype as a dict applies to pipelines; a single model takes a torch.dtype")
    config.warn_ignored()
    if config.strategy is not None:  # else the device budget picks it, and enable checks then
        config.check_applies(kind)
    if config.host_budget.auto:
        config = dataclasses.replace(config, host_memory=host_limit(config.strategy))
    return enable(inventory(_load(folder, index, torch_dtype, replaced)), config)


def host_limit(strategy: str | None) -> Any:
    """The ``host_memory`` a checkpoint is loaded under when none is given: with layerwise offload,
    or a device budget that may pick it, the automatic host limit (blocks beyond it stay in the
    checkpoint); model-level offload keeps every weight in RAM (None)."""
    return auto_host_budget() if strategy in ("layerwise", None) else None


def load(path: str | os.PathLike, torch_dtype: Any = None, **replaced_components: Any) -> Any:
    """The pipeline or model of a local folder, each model built on the meta device with its
    checkpoint slices attached, nothing read yet (:func:`from_pretrained` without the offload,
    which ``offload-core plan --model`` measures and ``run --model`` enables). ``torch_dtype``:
    as :func:`from_pretrained`'s."""
    folder = ModelFolder(path)
    return _load(folder, _model_index(folder), torch_dtype, replaced_components)


def _model_index(folder: ModelFolder) -> dict | None:
    return folder.read_json("model_index.json") if folder.has("model_index.json") else None


def _load(folder: ModelFolder, index: dict | None, torch_dtype: Any, replaced: dict[str, Any]) -> Any:
    if index is not None:
        return _load_pipeline(folder, index, torch_dtype, replaced)
    return _load_model(folder, checkpoint_dtype(folder) if torch_dtype == "auto" else torch_dtype)


def checkpoint_dtype(folder: ModelFolder | str | os.PathLike) -> torch.dtype | None:
    """The floating dtype most of a model folder's checkpoint bytes are in (None: no safetensors
    weights, or nothing floating): what ``torch_dtype="auto"`` loads it in. The files are those
    its loader reads (a diffusers model's, else a transformers model's), confined and checked."""
    folder = folder if isinstance(folder, ModelFolder) else ModelFolder(folder)
    found = folder.weight_files(WEIGHTS_INDEX_NAME, WEIGHTS_NAME) or \
        folder.weight_files(TRANSFORMERS_INDEX_NAME, TRANSFORMERS_WEIGHTS_NAME)
    sizes: dict[torch.dtype, int] = {}
    for item in read_index(found[0]).values() if found else ():
        if item.dtype.is_floating_point:
            sizes[item.dtype] = sizes.get(item.dtype, 0) + item.nbytes
    return max(sizes, key=sizes.get) if sizes else None


def _load_pipeline(folder: ModelFolder, index: dict, torch_dtype: Any, replaced: dict[str, Any]) -> Any:
    import diffusers

    where = os.path.join(folder.path, "model_index.json")
    pipeline_cls = _named_class(diffusers, index.get("_class_name"), diffusers.DiffusionPipeline, where,
                                "a diffusers pipeline class")
    if torch_dtype == "auto":  # each component in its checkpoint's dtype; the rest as diffusers' default
        torch_dtype = {name: dtype for name in index if not name.startswith("_")
                       if (dtype := checkpoint_dtype(folder.subfolder(name, where))) is not None}
    prebuilt = dict(replaced)
    for name, spec in index.items():
        if name in replaced or name.startswith("_") or not isinstance(spec, (list, tuple)) or len(spec) != 2 \
                or spec[0] not in ("diffusers", "transformers"):
            continue
        dtype = torch_dtype.get(name, torch_dtype.get("default", torch.float32)) if isinstance(torch_dtype, dict) \
            else torch_dtype
        model = _build(spec[0], spec[1], folder.subfolder(name, where), dtype, f"{where} ({name})")
        if model is not None:
            prebuilt[name] = model
    logger.info("%s: %s built by offload-core from the checkpoint; diffusers loads the rest",
                pipeline_cls.__name__, ", ".join(n for n in prebuilt if n not in replaced) or "no component")
    pipeline = pipeline_cls.from_pretrained(folder.path, dtype=torch_dtype, **prebuilt)
    for name, component in pipeline.components.items():
        if isinstance(component, nn.Module) and name not in prebuilt:
            _check_loaded(component, os.path.join(folder.path, name))
    return pipeline


def _build(library: str, class_name: object, folder: ModelFolder, dtype: torch.dtype | None,
           named_by: str) -> nn.Module | None:
    """A pipeline component built with its checkpoint tensors attached as file slices (a
    transformers model that the rules do not cover is read by transformers, see
    :mod:`.encoders`), or None for what diffusers loads itself (a scheduler, a
    tokenizer: any class of the library with a ``from_pretrained``, which diffusers calls)."""
    module = importlib.import_module(library)
    cls = _named_class(module, class_name, object, named_by, f"a {library} class that loads with from_pretrained")
    if not callable(getattr(cls, "from_pretrained", None)):
        raise CheckpointError(f"{named_by} names {library}.{class_name}, which has no from_pretrained to load it")
    if library == "transformers":
        import transformers

        if not issubclass(cls, transformers.PreTrainedModel):
            return None  # tokenizers, processors
        return _load_transformers(cls, folder, dtype)
    import diffusers

    if not issubclass(cls, diffusers.ModelMixin):
        return None
    return build_on_meta(cls, folder, dtype)


def _load_model(folder: ModelFolder, torch_dtype: torch.dtype | None) -> nn.Module:
    config = folder.read_json("config.json")
    where = os.path.join(folder.path, "config.json")
    if "_class_name" in config:
        import diffusers

        cls = _named_class(diffusers, config["_class_name"], diffusers.ModelMixin, where, "a diffusers model class")
        model = build_on_meta(cls, folder, torch_dtype)
        if model is None:
            model = _check_loaded(cls.from_pretrained(folder.path, dtype=torch_dtype), folder.path)
        return model
    import transformers

    architectures = config.get("architectures") or []
    if not (isinstance(architectures, list) and architectures):
        raise CheckpointError(f"{where} names neither a diffusers class (_class_name) nor a transformers one "
                              f"(architectures: {architectures!r})")
    cls = _named_class(transformers, architectures[0], transformers.PreTrainedModel, where,
                       "a transformers model class")
    return _load_transformers(cls, folder, torch_dtype)


def _named_class(module: Any, name: object, base: type, named_by: str, what: str) -> type:
    """The class ``name`` of ``module``, a subclass of ``base``; anything else (a function, a
    class of another kind, a name the module lacks) is refused before it is called."""
    found = getattr(module, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(found, type) and issubclass(found, base)):
        kind = "nothing" if found is None else ("a function" if callable(found) and not isinstance(found, type)
                                                else repr(found))
        raise CheckpointError(f"{named_by} names {name!r}, which in {module.__name__} is {kind}, not {what}")
    return found


def _check_loaded(model: nn.Module, folder: str) -> nn.Module:
    """A model its library loaded (checkpoint slices apart): refused if the library left a tensor
    on the meta device (a weight the checkpoint lacks), which nothing could compute with."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta and getattr(t, SOURCE_ATTRIBUTE, None) is None:
            raise CheckpointError(f"{folder}: the checkpoint has no tensor {name!r}, which {type(model).__name__} "
                                  "needs (its library left it on the meta device)")
    return model


def _load_transformers(cls: type, folder: ModelFolder, dtype: torch.dtype | None) -> nn.Module:
    """A transformers model with its checkpoint tensors attached as file slices, or, under a
    transformers whose loading internals :mod:`.encoders` does not know (it reads
    them from transformers 5's ``core_model_loading``), loaded by transformers as usual. Its
    config, shard index and safetensors headers are checked first, before transformers reads
    any of them."""
    folder.file("config.json", folder.path)
    found = folder.weight_files(TRANSFORMERS_INDEX_NAME, TRANSFORMERS_WEIGHTS_NAME)
    for path in found[0] if found is not None else ():
        read_header(path)
    try:
        from .encoders import load_from_checkpoint
    except (ImportError, KeyError) as exc:
        logger.info("%s: this transformers' loading internals are not the ones offload-core stands in for (%r); "
                    "transformers reads the checkpoint into memory", folder.path, exc)
        return _check_loaded(cls.from_pretrained(folder.path, dtype=dtype), folder.path)
    return _check_loaded(load_from_checkpoint(cls, folder.path, dtype), folder.path)


def build_on_meta(cls: type, folder: ModelFolder | str, torch_dtype: torch.dtype | None) -> nn.Module | None:
    """A ``cls`` model whose checkpoint tensors are meta tensors carrying their file slices, or
    None when diffusers' own loader must handle the folder (no safetensors weights, a quantized
    checkpoint's keys and shapes). Every checkpoint header is checked, and every file confined to
    the folder, before the model is built."""
    folder = folder if isinstance(folder, ModelFolder) else ModelFolder(folder)
    found = folder.weight_files(WEIGHTS_INDEX_NAME, WEIGHTS_NAME)
    if torch_dtype is not None and torch_dtype.itemsize == 1:
        return None  # diffusers casts to 8-bit floats after loading, in its own way
    if found is None:
        logger.info("%s: no safetensors weights; diffusers loads it", folder.path)
        return None
    files, sharded = found
    slices = read_index(files)
    config = cls.load_config(folder.file("config.json", folder.path))
    with _empty_construction(cls, torch_dtype):
        model = cls.from_config(config)
    if not sharded:
        model._fix_state_dict_keys_on_load(slices)
    state = model.state_dict(keep_vars=True)
    if not any(isinstance(t, nn.Parameter) for t in state.values()):
        return None  # enable_offload packs modules with parameters only: nothing would read the buffers
    missing = [key for key, t in state.items() if key not in slices and t.is_meta]
    mismatched = [key for key, t in state.items() if key in slices and tuple(slices[key].shape) != tuple(t.shape)]
    if (missing or mismatched) and "quantization_config" in config:
        logger.warning("%s: %d weights missing from the checkpoint and %d of another shape (%s), under a "
                       "quantization config; diffusers loads it", folder.path, len(missing), len(mismatched),
                       ", ".join((missing + mismatched)[:4]))
        return None
    # diffusers cannot load these either (it leaves a missing weight on the meta device, refuses a
    # shape), and its key fixes are the ones applied above
    if missing:
        raise CheckpointError(f"{', '.join(sorted(files))}: no tensor {missing[0]!r}, which {cls.__name__} needs "
                              f"({len(missing)} weights missing)")
    if mismatched:
        key = mismatched[0]
        raise CheckpointError(f"{slices[key].file.path}: tensor {key!r} has shape {list(slices[key].shape)}, but "
                              f"{cls.__name__} as configured needs {list(state[key].shape)}")
    keep_fp32 = cls._keep_in_fp32_modules or []
    keep_fp32 = [keep_fp32] if isinstance(keep_fp32, str) else list(keep_fp32)

    def dtype_of(key: str, t: torch.Tensor, source: FileSlice) -> torch.dtype:
        if torch_dtype is None or not source.dtype.is_floating_point:
            return t.dtype
        return torch.float32 if any(m in key.split(".") for m in keep_fp32) else torch_dtype

    attach_slices(model, {key: slices[key] for key in state if key in slices}, dtype_of,
                  lambda t, dtype: t.requires_grad)
    model.eval()
    model.register_to_config(_name_or_path=folder.path)
    return model


@contextlib.contextmanager
def _empty_construction(cls: type, torch_dtype: torch.dtype | None) -> Iterator[None]:
    """Build a model as diffusers does before loading: parameters on the meta device (buffers,
    which checkpoints may not hold, really computed), initialisers skipped, and the default dtype
    set to ``torch_dtype``."""
    from diffusers.models.modeling_utils import no_init_weights

    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            param = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    previous = cls._set_default_torch_dtype(torch_dtype) if torch_dtype is not None else None
    nn.Module.register_parameter = register_on_meta
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register
        if previous is not None:
            torch.set_default_dtype(previous)
