"""``transformers`` models of a local folder built on the meta device, each checkpoint tensor
attached as its file slice (as :mod:`offload_core.pretrained.load` does for diffusers models), so that
a text encoder's blocks are read straight into their homes or stay in its checkpoint.

The result must equal transformers' own ``from_pretrained``, whose rules change between versions
(v5: the default dtype "auto" read from the config or the checkpoint, construction on the meta
device under that dtype, ``_keep_in_fp32_modules`` plans, checkpoint key renames, ties resolved
after loading, non-persistent buffers such as rotary ``inv_freq`` recomputed by the model's own
initialisers, ``eval()``, the generation config). So transformers' ``from_pretrained`` runs as
it is, and only the one step that reads the checkpoint, ``_load_pretrained_model``, is replaced,
for the calling thread and the model the call builds: it attaches slices instead of reading
tensors (from every shard of a sharded checkpoint), applying that step's own renames and dtype
rules, and reports missing and unexpected keys as it would, so that transformers finishes the
model (ties, buffers, init of what no file holds). A checkpoint these rules do not cover (a key
conversion beyond a rename, quantization, weights missing or of another shape, other formats, a
device map, tensor-parallel or DeepSpeed loading) is read by transformers' own step, with a log
line saying why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    build_glob_alternation,
    dot_natural_key,
    rename_source_key,
)
from transformers.integrations import is_deepspeed_zero3_enabled, is_fsdp_enabled
from transformers.utils.loading_report import LoadStateDictInfo

from ..hostmem.disk import read_index
from ..base.locks import locked
from ..weights.checkpoint import attach_slices
from ..weights.slices import FileSlice

logger = logging.getLogger(__name__)

#: transformers' own checkpoint-reading step, which this module stands in for
_READ_CHECKPOINT = PreTrainedModel.__dict__["_load_pretrained_model"]
#: elements compared at a time when a tie's two tensors are both in the checkpoint
_COMPARE_CHUNK = 1 << 22

_lock = threading.Lock()
_users = 0
_state = threading.local()


class _Uncovered(Exception):
    """Why a checkpoint is left to transformers' own reading step."""


def load_from_checkpoint(cls: type, folder: str, dtype: torch.dtype | None) -> nn.Module:
    """``cls.from_pretrained(folder, dtype=dtype)`` (as diffusers calls it for a pipeline's
    component), its checkpoint tensors attached as file slices where the rules cover it. Without
    hub kernels: transformers 5.25 swaps layers for them by default when ``kernels`` is installed,
    which fails on tensors that are file slices (the meta device) and would change the modules."""
    with _slices_instead_of_reads(cls):
        return cls.from_pretrained(folder, dtype=dtype, use_kernels=False)


@contextlib.contextmanager
def _slices_instead_of_reads(cls: type) -> Iterator[None]:
    """Stand in for transformers' reading step in this thread for the next ``cls`` model it reads;
    other threads and other models keep transformers' own."""
    locked(_lock, _count_users, 1)
    _state.armed = cls
    try:
        yield
    finally:
        _state.armed = None
        locked(_lock, _count_users, -1)


def _count_users(step: int) -> None:
    """One more (``step`` 1) or one fewer (-1) load in progress: the stand-in is in place while
    there is one."""
    global _users
    _users += step
    PreTrainedModel._load_pretrained_model = staticmethod(_read_as_slices) if _users else _READ_CHECKPOINT


def _read_as_slices(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    """``PreTrainedModel._load_pretrained_model``'s stand-in: the loading report of reading the
    checkpoint, with the tensors attached as slices instead of read."""
    read = _READ_CHECKPOINT.__func__
    if type(model) is not getattr(_state, "armed", None):
        return read(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    _state.armed = None  # that model only: adapters and nested loads read as usual
    try:
        given = state_dict is not None or any(a is not None for a in (*args, *kwargs.values()))
        found, missing, unexpected = _match_keys(model, given, checkpoint_files, load_config)
    except _Uncovered as why:
        logger.info("%s (%s): %s; transformers reads its checkpoint into memory",
                    load_config.pretrained_model_name_or_path, type(model).__name__, why)
        return read(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    dtype_plan = load_config.dtype_plan or {}
    if dtype_plan:
        policy, groups, _ = build_glob_alternation(list(dtype_plan))

    def dtype_of(key: str, t: torch.Tensor, source: FileSlice) -> torch.dtype:
        # the meta model was built under the load's dtype: its tensors' dtypes are the targets,
        # except where the load's dtype_plan (transformers' name) matches (convert_and_load_state_dict_in_model)
        match = policy.search(key) if dtype_plan else None
        return dtype_plan[groups[match.lastgroup]] if match else t.dtype

    attached = attach_slices(model, found, dtype_of, lambda t, dtype: dtype.is_floating_point)
    for t in attached.values():
        t._is_hf_initialized = True  # transformers' initialisers skip it, as they skip a loaded tensor
    model._weight_conversions = [c for c in (load_config.weight_mapping or []) if c.was_used()]
    info = LoadStateDictInfo(missing_keys=missing, unexpected_keys=unexpected, mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    return info, None


def _match_keys(model, given: bool, files, load_config) -> tuple[dict[str, FileSlice], set[str], set[str]]:
    """The slice of each model key the checkpoint holds (its renames applied as transformers
    applies them), the keys it lacks, and the checkpoint keys the model has no place for.
    ``given``: the step was given a state dict or the keys to expect."""
    if given:
        raise _Uncovered("it is given a state dict or the keys to expect")
    if load_config.hf_quantizer is not None:
        raise _Uncovered("it has a quantization config")
    if load_config.device_map is not None or load_config.device_mesh is not None or getattr(model, "_pp_stage", None) \
            is not None or is_deepspeed_zero3_enabled() or is_fsdp_enabled():
        raise _Uncovered("it is loaded with a device map, tensor or pipeline parallelism, DeepSpeed or FSDP")
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        raise _Uncovered("its weights are not safetensors")
    try:
        slices = read_index(files)
    except ValueError as exc:
        raise _Uncovered(str(exc)) from None
    expected = model.state_dict()
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    found: dict[str, FileSlice] = {}
    unexpected: set[str] = set()
    for key in sorted(slices, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:  # as transformers: only the prefix may change
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if renamed not in expected:
            unexpected.add(renamed)
        elif pattern is not None:
            raise _Uncovered(f"checkpoint tensor {key} needs a conversion, not only a rename")
        elif renamed in found:
            raise _Uncovered(f"two checkpoint tensors load into {renamed}")
        elif tuple(slices[key].shape) != tuple(expected[renamed].shape):
            raise _Uncovered(f"checkpoint tensor {key} has shape {list(slices[key].shape)}, the model's "
                             f"{renamed} {list(expected[renamed].shape)}")
        else:
            found[renamed] = slices[key]
    _resolve_ties(model, found)
    missing = set(expected) - set(found)
    tied = model.all_tied_weights_keys
    partners = {k: v for t, s in tied.items() for k, v in ((t, s), (s, t))}
    uncovered = sorted(k for k in missing if partners.get(k) not in found)
    if uncovered:
        raise _Uncovered(f"{len(uncovered)} weights are missing from the checkpoint ({', '.join(uncovered[:4])})")
    return {key: found[key] for key in expected if key in found}, missing, unexpected


def _resolve_ties(model, found: dict[str, FileSlice]) -> None:
    """A tie whose two tensors are both in the checkpoint: transformers ties them when their
    values are equal, and otherwise warns and keeps them apart. Equal: the target's slice is
    dropped, and transformers' tying gives it the source. The values are compared a chunk at a
    time, in the dtype they load in."""
    expected = model.state_dict()
    for target, source in list(model.all_tied_weights_keys.items()):
        if target not in found or source not in found:
            continue
        if _equal(found[source], found[target], expected[target].dtype):
            del found[target]
        else:
            logger.warning("%s: %s and %s are tied but both in the checkpoint with different values: they are "
                           "not tied", type(model).__name__, source, target)
            model.all_tied_weights_keys.pop(target)


def _equal(a: FileSlice, b: FileSlice, dtype: torch.dtype) -> bool:
    if a.shape != b.shape:
        return False
    for start in range(0, a.numel, _COMPARE_CHUNK):
        count = min(_COMPARE_CHUNK, a.numel - start)
        x, y = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
        a.read(start, count, x)
        b.read(start, count, y)
        if not torch.equal(x, y):
            return False
    return True
