"""Autograd through streamed blocks: saved weights become references, reloaded in backward.

A block's parameters view its device slot only while the block's forward runs; the slot is then
refilled with a later block. Autograd, left alone, would keep what the forward saved for backward
(``addmm`` keeps ``weight.t()``, a view of the slot) and read another block's weights in backward.
So while a streamed block runs with autograd recording, a saved-tensor hook replaces every saved
tensor that views a slot by a :class:`SlotRef` (block, dtype, offset, shape, stride): device memory
holds no weights for backward, only activations. In backward, the first reference of a block makes
sure the block is in its slot again, loaded from its host home (the truth) like in a forward, and
queues the copies of the blocks whose backward comes next (the reverse of the forward's order), so
that they overlap this block's backward: every block is copied once per forward and once per
backward (less the last blocks of the forward, still in their slots when backward starts), and
device memory stays the slots plus activations.

A compute-dtype copy a layer made of its slot view (diffusers' layerwise casting: float8 stored,
bfloat16 computed) is saved the same way, as the view it came from, and cast again when backward
reads it. Hooks that were already active around the block (non-reentrant gradient checkpointing,
the user's own ``saved_tensors_hooks``) still see every saved tensor that is neither.

torch skips its own check that a saved tensor was not changed in place since it was saved ("modified
by an inplace operation") for every tensor a pack hook takes. So the hooks make that check
themselves, for every tensor they take: a tensor that is no slot view is kept with its version
(:class:`_Kept`), a slot view of a parameter with the parameter's version, and backward refuses a
tensor whose version moved, as autograd does without offload (also a weight an optimizer stepped
inside backward, from a post-accumulate-grad hook, before a later saved use of it is read).

The backward's last act (an autograd engine callback) waits for the copies it queued, so that an
optimizer step that writes the host weights right after never races a copy reading them, and the
slots are forgotten: the next forward loads afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch
from torch._C import _autograd
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..base.errors import OffloadedModelError
from ..base.locks import locked
from ..weights.binding import CAST_COPIES
from ..weights.layout import storage_key

if TYPE_CHECKING:
    from .ring import LoadRecord, SlotRing

#: the hooks active around a block, to which saved tensors that are not slot views go (torch builds
#: without this accessor shadow them: the outer hooks then see no tensor saved inside a block)
_autograd_top = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_outer_hooks: Callable[[], Any] = _autograd_top or (lambda _: None)
#: which backward is running (torch builds without it: a backward that failed is seen as over only
#: when the next forward starts)
_graph_task: Callable[[], Any] = getattr(torch._C, "_current_graph_task_id", lambda: None)


def backward_running() -> bool:
    """Whether this thread runs inside an autograd backward, where a checkpoint's recompute calls
    blocks again (False on torch builds without the accessor)."""
    return _graph_task() not in (None, -1)


_functorch = getattr(torch._C, "_functorch", None)
_interpreters: Callable[[], Any] = getattr(_functorch, "get_interpreter_stack", lambda: None)
#: torch.func transforms that differentiate (grad, vjp, jacrev, jacfwd, jvp, hessian): they trace
#: the offload's own copies into slots and homes as mutations of captured tensors; vmap does not
_DIFFERENTIATING = frozenset(
    getattr(getattr(_functorch, "TransformType", None), name, name) for name in ("Grad", "Jvp")
)


def refuse_function_transforms(what: str) -> None:
    """Before an offloaded model runs: refused inside ``torch.func.grad`` / ``jacrev`` / ``jvp``
    (and the transforms built on them) with an error that names the way that works, before any
    state changes, instead of torch's internal errors from the middle of a copy."""
    stack = _interpreters()
    if stack and any(interpreter.key() in _DIFFERENTIATING for interpreter in stack):
        raise OffloadedModelError(
            f"{what} is offloaded: torch.func.grad, vjp, jacrev, jacfwd, jvp and hessian cannot differentiate through "
            "offload-core's weight copies. Use loss.backward() or torch.autograd.grad (exact through offloading), or "
            "call handle.disable() first; torch.func.vmap works"
        )


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward running on this thread ends (an autograd engine callback,
    which runs only if the backward succeeds); False outside a backward (a saved tensor read
    through ``grad_fn._saved_*``)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


def _pop(hooks: Any, pack: Callable) -> None:
    """Leave the saved-tensor ``hooks`` context whose pack hook is ``pack``, if it is still the
    innermost one: an exit interrupted after it popped them, and repeated, pops nobody else's."""
    top = _outer_hooks(False)
    if top is None and _outer_hooks is not _autograd_top or top is not None and top[0] == pack:
        hooks.__exit__(None, None, None)


@dataclasses.dataclass(frozen=True)
class SlotRef:
    """A saved tensor that viewed block ``block``'s weights in its slot: its place in the slot's
    buffer of ``dtype``, so that it can be viewed again wherever the block is loaded next."""

    epoch: int  # the enable that packed the block: a re-pack lays the slots out anew
    block: int
    dtype: torch.dtype
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    param: Any = None  # the parameter it views (weakly), whose version must not move before backward
    version: int = 0  # that parameter's version when it was saved


@dataclasses.dataclass(frozen=True)
class _Recast:
    """A saved compute-dtype copy of a slot view (``weights.binding.CAST_COPIES``): the view's
    reference, and how the saved tensor lies in the copy, which casting the view again rebuilds."""

    source: SlotRef
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A saved tensor that is no slot view, kept as it is with its version when it was saved."""

    tensor: torch.Tensor
    version: int


def _keep(t: torch.Tensor) -> _Kept:
    """``t`` detached (same memory and version counter): kept with its ``grad_fn``, a tensor the
    graph's own node produced would hold that node, a cycle through C++ that no garbage collection
    frees, and the whole graph would outlive its output (torch's ``saved_tensors_hooks`` warns of it)."""
    return _Kept(t.detach(), t._version)


def _keep_alias(t: torch.Tensor) -> _Kept:
    """A parameter that goes home to other data before backward reads it (autograd saves the
    parameter itself and reads what it shows then): a detached alias of what it shows now, which
    shares its version counter, so that a weight changed in place before backward is refused as
    without offload."""
    return _Kept(t.detach(), t._version)


def _parameter_of(t: torch.Tensor, owners: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> Any:
    """The parameter whose version a saved ``t`` that views a device copy shares: ``t`` itself, the
    parameter it is a view of, or (a ``detach()``, sharing the version counter too) the one of
    ``owners`` (parameter, its device view) whose view holds ``t``'s first element; None for a
    buffer. A substituted parameter's view (another copy) never holds it."""
    if isinstance(t, torch.nn.Parameter):
        return t
    if isinstance(t._base, torch.nn.Parameter):
        return t._base
    key, offset = storage_key(t), t.storage_offset()
    for param, view in owners:
        if view.dtype == t.dtype and view.numel() and storage_key(view) == key:
            start = view.storage_offset()
            if start <= offset < start + sum((n - 1) * abs(st) for n, st in zip(view.shape, view.stride())) + 1:
                return param
    return None


def _check_version(t: torch.Tensor, version: int) -> None:
    """Autograd's own check of a saved tensor, which torch skips for tensors a hook took."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
            "(offload-core's saved-tensor hooks check this as autograd does without offload)"
        )


def _unkept(packed: _Kept) -> torch.Tensor:
    _check_version(packed.tensor, packed.version)
    return packed.tensor


@dataclasses.dataclass(frozen=True)
class _Outer:
    """A saved tensor handed to the hooks that were active around the block."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """A saved wrapper subclass (``__tensor_flatten__``), its parts packed one by one."""

    cls: type
    context: Any
    shape: torch.Size
    stride: tuple[int, ...]
    parts: dict[str, Any]


class StreamedPart(Protocol):
    """What the backward reads of a layerwise part: the seam between autograd and the streaming,
    kept narrow so that either can change without the other."""

    lock: threading.RLock  # taken around a backward's reads, as around a forward's
    ring: "SlotRing | None"  # its slot ring (None while parked)
    records: "list[LoadRecord]"  # one per streamed block: its binding (parameters, versions)

    @property
    def epoch(self) -> int | None:
        """The enable whose slots autograd's references may read: None while disabled."""

    def substituted(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a parameter the running block binds to a device copy of data given it,
        which goes home before backward."""

    def block_label(self, i: int) -> str:
        """"block <name> of <model>", for error messages."""

    def load_for_backward(self, i: int, miss: bool) -> None:
        """Block ``i`` in its slot: loaded after the compute issued so far unless it is there."""

    def wait_ready(self, i: int) -> None:
        """Compute waits until block ``i`` is in its slot."""

    def end_backward(self) -> None:
        """Wait for the backward's copies, forget what the slots hold."""


class SavedSlots:
    """The saved-tensor hooks of one layerwise strategy and the reloads of its backward.

    ``strategy`` (a :class:`StreamedPart`, held weakly: a graph kept after ``disable`` must not
    keep the model's device memory alive)."""

    def __init__(self, strategy: StreamedPart) -> None:
        self._strategy = weakref.ref(strategy)
        self._slot_of: dict[int, tuple[int, torch.dtype]] = {}  # storage address -> (slot, dtype)
        self._order: list[int] = []  # blocks in the order their forwards saved weights
        self._stale = False  # a backward ended: the next recording forward starts a new order
        self._cursor = -1  # where in _order the running backward is
        self._in_backward = False
        self._task: Any = None  # the running backward's graph task
        self._checked: set[int] = set()  # blocks whose versions this backward has checked
        self._versions: dict[int, tuple[int, ...]] = {}  # block -> its weights' versions after its forward
        self.recorded = False  # a reference was made since the strategy last cleared this
        self._block: int | None = None  # the block whose forward is recording, once it saved a weight
        self._hooks: Any = None
        self._outer: Any = None

    # -- the slots' memory ---------------------------------------------------------------------
    def index(self, slot_of: dict[int, tuple[int, torch.dtype]]) -> None:
        """Learn which storage is which slot (``SlotRing.views_index``; again after a slot was
        replaced)."""
        self._slot_of = slot_of

    # -- forward ---------------------------------------------------------------------------------
    def begin_block(self) -> None:
        """Around a block's forward, when autograd records: saved slot views become references.
        Paired with :meth:`end_block`."""
        self._outer = _outer_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def end_block(self) -> None:
        """After the block's forward: note its weights' versions, so that a backward after an
        in-place change to them is refused, as autograd refuses it without offload."""
        if self._hooks is not None:
            _pop(self._hooks, self._pack)  # then forgotten: an interrupt in between is finished by the next call
            self._hooks = self._outer = None
            if self._block is not None:
                self._versions[self._block] = self._strategy().records[self._block].binding.versions()
                self._block = None

    def _pack(self, t: torch.Tensor) -> Any:
        if is_traceable_wrapper_subclass(t):  # a quantized weight: its parts may view the slot
            names, context = t.__tensor_flatten__()
            parts = {name: self._pack(getattr(t, name)) for name in names}
            return _Wrapped(type(t), context, t.shape, t.stride(), parts)
        try:
            where = self._slot_of.get(t.untyped_storage().data_ptr())
        except RuntimeError:  # no storage (a subclass without one, a sparse layout): not a slot view
            where = None
        if where is None or t.dtype != where[1]:
            if where is not None:  # a slot view reinterpreted as another dtype: keep a copy of it
                return _keep(t.detach().clone())
            recast = self._recast(t)
            if recast is not None:
                return recast
            outer = self._outer
            if outer is not None:
                return _Outer(outer[0](t), outer[1])
            return _keep_alias(t) if self._strategy().substituted(t) else _keep(t)
        slot, dtype = where
        strategy = self._strategy()
        ring = strategy.ring
        block = ring.occupant(slot)
        self._block, self.recorded = block, True
        if not self._order or self._order[-1] != block:
            if self._stale:
                self._order, self._stale = [], False
            self._order.append(block)
            self._trim()
        base = ring.buffer(slot, dtype)
        offset = t.storage_offset() - base.storage_offset()
        binding = strategy.records[block].binding
        param = _parameter_of(t, zip(binding.params, binding.params_device))
        owner = (weakref.ref(param), param._version) if param is not None else (None, 0)
        return SlotRef(strategy.epoch, block, dtype, offset, t.shape, t.stride(), *owner)

    def _recast(self, t: torch.Tensor) -> _Recast | None:
        """``t`` as a reference to the slot view it was cast from, when it views a compute-dtype
        copy of one (diffusers' layerwise casting): the graph then keeps no weight, in either dtype."""
        found = CAST_COPIES.get(t.untyped_storage().data_ptr())
        if found is None:
            return None
        copy, source = found
        if copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() \
                or source.untyped_storage().data_ptr() not in self._slot_of:
            return None
        return _Recast(self._pack(source), copy.dtype, t.shape, t.stride(), t.storage_offset())

    def _trim(self) -> None:
        """Forwards with autograd on and no backward (a model run without ``no_grad``) must not
        grow the order for ever: keep the most recent forwards."""
        limit = 4 * max(len(self._strategy().records), 1)
        if len(self._order) > limit:
            del self._order[: len(self._order) - limit]

    # -- backward --------------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Kept:
            return _unkept(packed)
        if type(packed) is _Recast:  # the copy's layout is that of the view cast again
            return self._unpack(packed.source).to(packed.dtype).as_strided(packed.shape, packed.stride, packed.offset)
        if type(packed) is _Outer:
            return packed.unpack(packed.packed)
        if type(packed) is _Wrapped:
            parts = {name: self._unpack(part) for name, part in packed.parts.items()}
            return packed.cls.__tensor_unflatten__(parts, packed.context, packed.shape, packed.stride)
        if type(packed) is not SlotRef:
            return packed
        strategy = self._strategy()
        if strategy is None or strategy.epoch != packed.epoch:
            raise RuntimeError(
                "this backward reads weights of an offloaded block, but the offload was disabled or re-packed "
                "(a structural change) since the forward that saved them: run backward before handle.disable() "
                "or before changing the model's structure"
            )
        return locked(strategy.lock, self._unpack_slot, strategy, packed)

    def _unpack_slot(self, strategy, packed: SlotRef) -> torch.Tensor:
        task = _graph_task()
        first = not self._in_backward or task != self._task
        if first:
            if self._in_backward:  # a backward that raised before its end
                strategy.end_backward()
            if not self._begin_backward(task):
                return self._read_outside_backward(strategy, packed)
        i = packed.block
        if i not in self._checked:
            self._check_versions(strategy, i)
        param = packed.param() if packed.param is not None else None
        if param is not None and param._version != packed.version:
            self._checked.discard(i)
            self._check_versions(strategy, i, force=True)
        strategy.load_for_backward(i, miss=not first)
        self._prefetch(i)
        return _view(strategy, packed)

    def _check_versions(self, strategy, i: int, force: bool = False) -> None:
        if force or strategy.records[i].binding.versions() != self._versions.get(i):
            raise RuntimeError(
                f"a weight of {strategy.block_label(i)} that this backward needs was "
                "modified in place after the forward that used it (an optimizer step, load_state_dict, a write "
                "under no_grad); without offload autograd refuses this too. Run backward before changing weights"
            )
        self._checked.add(i)

    def _begin_backward(self, task: Any) -> bool:
        """Returns False outside a backward (a saved tensor read through ``grad_fn._saved_*``)."""
        if not at_backward_end(functools.partial(self._end_backward, task)):
            return False
        self._in_backward, self._task = True, task
        self._checked.clear()
        self._cursor = len(self._order) - 1
        return True

    def _read_outside_backward(self, strategy, packed: SlotRef) -> torch.Tensor:
        """A saved weight read outside a backward: a copy of it, which no later load can change."""
        strategy.load_for_backward(packed.block, miss=True)
        copy = _view(strategy, packed).clone()
        strategy.end_backward()
        return copy

    def _prefetch(self, i: int) -> None:
        """Queue the loads of the blocks whose backward follows block ``i``'s (each into a slot
        that is neither ``i``'s nor another of these)."""
        strategy, order = self._strategy(), self._order
        cursor = self._cursor
        if not (0 <= cursor < len(order)) or order[cursor] != i:
            below = [k for k in range(min(cursor, len(order) - 1), -1, -1) if order[k] == i]
            if not below:
                return
            cursor = self._cursor = below[0]
        ring = strategy.ring
        taken = {ring.slot_of(i)}
        k = cursor - 1
        while k >= 0 and len(taken) < len(ring):  # the other slots, each once
            j = order[k]
            slot = ring.slot_of(j)
            if slot not in taken:
                taken.add(slot)
                strategy.load_for_backward(j, miss=False)
            k -= 1

    def forget_backward(self) -> bool:
        """A forward starts: a backward that raised before its end (its callback never ran) is
        over. Returns whether there was one, which the strategy must then end."""
        if not self._in_backward:
            return False
        self._in_backward, self._stale = False, True
        return True

    def _end_backward(self, task: Any) -> None:
        if not self._in_backward or task != self._task:
            return  # a backward already ended (by a later one that found it unfinished)
        strategy = self._strategy()
        if strategy is not None and strategy.epoch is not None:
            locked(strategy.lock, strategy.end_backward)
        # only now: an end interrupted half-way is still to do, by the next forward (forget_backward)
        self._in_backward = False
        self._stale = True


def _view(strategy, packed: SlotRef) -> torch.Tensor:
    """The saved tensor again: a view of its block's slot, once compute waits for the block."""
    strategy.wait_ready(packed.block)
    base = strategy.ring.buffers_of(packed.block)[packed.dtype]
    return base.as_strided(packed.shape, packed.stride, base.storage_offset() + packed.offset)


@dataclasses.dataclass(eq=False)
class DeviceCopy:
    """One load of a model-level component onto the device, as the weights autograd saved from it
    see it: ``buffers`` (per dtype) until the component is loaded again or offload disabled, then
    None (released), so that a graph kept without a backward holds no device copy beyond the
    latest. ``part`` (held weakly) reads a released copy's weights again: ``saved_buffers(copy)``."""

    part: Any  # weakref.ref to the model-level part
    name: str  # the component
    epoch: int  # the enable that packed it: a re-pack lays the component out anew
    buffers: dict[torch.dtype, torch.Tensor] | None

    def release(self) -> None:
        self.buffers = None


@dataclasses.dataclass(frozen=True)
class _SavedWeight:
    """A saved parameter (or a part of a quantized one) that viewed a component's device copy:
    where in the copy's buffer of ``dtype``, and the parameter's version when it was saved."""

    copy: DeviceCopy
    dtype: torch.dtype
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    param: Any  # weakref.ref to the parameter
    version: int


class SavedParameters:
    """Autograd saves a parameter it needs for backward as the parameter itself, and reads whatever
    the parameter shows when backward runs. Model-level offload sends a component home when its
    forward ends, so that backward would read the host copy (on an accelerator, the wrong device).
    Inside this context a saved tensor that views one of ``copies`` (the active components'
    :class:`DeviceCopy`: a weight, ``weight.t()``) becomes a reference into that copy, checked
    against its parameter's version as autograd checks it without offload: backward reads the copy
    while it is held (no reload for the usual forward-then-backward), and once the component's next
    load or ``disable()`` released it, its part makes the component active again
    (``saved_buffers``). A saved buffer of the copy is kept as a copy of its own (a graph kept
    without a backward holds its bytes only, not the component's). Other saved tensors go to the
    hooks that were active around it; none is kept with its ``grad_fn`` (a cycle through the graph,
    which no garbage collection frees). ``bindings``: the active components' bindings, which say
    which parameter a detached view of the copy belongs to."""

    def __init__(self, copies: list[DeviceCopy], bindings: list) -> None:
        self._copies = {
            buffer.untyped_storage().data_ptr(): (copy, dtype, buffer.storage_offset())
            for copy in copies
            for dtype, buffer in (copy.buffers or {}).items()
            if buffer.numel()
        }
        self._bindings = bindings
        self._outer: Any = None
        self._hooks: Any = None

    def __enter__(self) -> "SavedParameters":
        self._outer = _outer_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_saved)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            _pop(self._hooks, self._pack)
            self._hooks = None  # it holds the bound pack hook: a cycle, freed only by a garbage collection
        # the graph holds the pack hook, hence this object, as long as it lives: not the device copies
        self._copies, self._bindings = {}, []

    def _pack(self, t: torch.Tensor) -> Any:
        if is_traceable_wrapper_subclass(t):  # a quantized weight: its parts view the copy
            names, context = t.__tensor_flatten__()
            parts = {name: self._pack(getattr(t, name)) for name in names}
            return _Wrapped(type(t), context, t.shape, t.stride(), parts)
        try:
            where = self._copies.get(t.untyped_storage().data_ptr())
        except RuntimeError:  # no storage: not a view of a device copy
            where = None
        if where is None:
            if isinstance(t, torch.nn.Parameter):  # another component's weight, at home
                return _keep_alias(t)
            outer = self._outer
            return _keep(t) if outer is None else _Outer(outer[0](t), outer[1])
        copy, dtype, start = where
        owners = ((p, v) for b in self._bindings for p, v in zip(b.params, b.params_device))
        param = _parameter_of(t, owners) if t.dtype == dtype else None
        if param is None:  # a buffer, or a view reinterpreted as another dtype
            return _keep(t.detach().clone())
        offset = t.storage_offset() - start
        return _SavedWeight(copy, dtype, offset, t.shape, t.stride(), weakref.ref(param), param._version)


def _unpack_saved(packed: Any) -> torch.Tensor:
    if type(packed) is _Outer:
        return packed.unpack(packed.packed)
    if type(packed) is _Wrapped:
        parts = {name: _unpack_saved(part) for name, part in packed.parts.items()}
        return packed.cls.__tensor_unflatten__(parts, packed.context, packed.shape, packed.stride)
    if type(packed) is not _SavedWeight:
        return _unkept(packed)
    param = packed.param()
    if param is not None:
        _check_version(param, packed.version)
    buffers = packed.copy.buffers
    if buffers is None:
        part = packed.copy.part()
        if part is None:
            raise RuntimeError(
                "this backward reads weights of a model-level offloaded component whose offload is gone "
                "(the model was dropped): run backward before dropping the model"
            )
        buffers = part.saved_buffers(packed.copy)
    base = buffers[packed.dtype]
    return base.as_strided(packed.shape, packed.stride, base.storage_offset() + packed.offset)
