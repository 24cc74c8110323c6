"""What every strategy instance ("part") of a handle shares beyond the transport: the handle's
lock, instrumentation that can be taken off and put back (plain copies), re-packing after a
structural change, and changes copied home."""

from __future__ import annotations

import contextlib
import copy
import copyreg
import logging
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..common import changes
from ..base.errors import OffloadedModelError, RepackError
from ..common.transaction import Transaction
from ..weights.layout import same_layout
from .calls import CallWrapper
from .common import Counters

logger = logging.getLogger(__name__)


class Part:
    """What every strategy instance inside a handle shares: counters, the handle's lock, the
    ``dirty`` flag set when the model's structure changes, instrumentation that can be taken off
    and put back (for plain copies), and re-packing.

    Subclasses implement ``enable(txn)``, ``disable()`` (resumable: an interrupted call can be
    repeated), ``modules()`` (the roots they cover), ``host_units()`` (for the placement policy),
    ``truth()``, ``_instrument()`` and ``_replan()``."""

    #: set while ``handle.trace()`` records; the strategy records into it
    timeline = None

    def __init__(self, backend) -> None:
        self.backend = backend
        self.placement = None  # where the units' homes are (hostmem.placement), set before enable
        self.counters = Counters()
        self.lock = threading.RLock()  # the handle's lock, once joined (see join())
        self.handle: Any = None  # the handle, once joined: gives plain copies and homes for re-packs
        self.dirty = False  # the structure changed (a module or tensor added): re-pack before use
        self.enabled = False
        self._hooks: list = []
        self._no_repack: str | None = None  # inside no_repack(): what would have asked for one
        # its blocks run once per pipeline call (a text encoder's), not every denoising step: the
        # placement gives RAM to the others' blocks first (hostmem.placement)
        self.once_per_call = False
        self.switch = None  # the handle's phase switch (phases.py), told when this part's components begin

    def join(self, handle: Any) -> None:
        """Before ``enable``: the part serves ``handle``, sharing its lock, making plain copies
        through it and asking it for homes when it packs again. A part enabled alone has its own
        lock and the default placement."""
        self.lock = handle.lock
        self.handle = handle

    @contextlib.contextmanager
    def no_repack(self, during: str) -> Iterator[None]:
        """Refuse re-packing inside: a call has begun and bound its modules, so a structural change
        made ``during`` it raises :func:`changed_during_call` (the next call re-packs)."""
        self._no_repack = during
        try:
            yield
        finally:
            self._no_repack = None

    def truth(self) -> list[tuple[Any, list[torch.Tensor], dict]]:
        """(unit, views its owners show, buffers holding its true values) per packed unit."""
        raise NotImplementedError

    def _instrument(self) -> None:
        raise NotImplementedError

    def peak_from_here(self) -> int:
        """Start measuring what a call takes on the device: the backend's peak counter starts
        again from now (the handle keeps the peak before it, for ``stats()``); returns the device
        memory allocated now."""
        if self.handle is not None:
            self.handle.restart_peak()
        else:
            self.backend.reset_peak_memory_stats()
        return self.backend.memory_allocated()

    def measured_activations(self) -> dict[str, int]:
        """Device bytes each of its components' first call took beyond the weights (none measured)."""
        return {}

    # -- phases (phases.py) -----------------------------------------------------------------------
    def yields(self) -> list[str]:
        """The components of this part that give the device up while other phases run (none)."""
        return []

    def give_way(self, component: str) -> None:
        """Another component begins: ``component`` (one of :meth:`yields`) gives the device up."""

    def _wrap(self, module: nn.Module, before, after, device: torch.device | None = None) -> None:
        """Wrap ``module``'s calls (see :class:`CallWrapper`), under the handle's lock; copies of the
        module go through the handle."""
        wrappers = [CallWrapper(module, before, after, device, self.lock)]
        if self.handle is not None:
            wrappers.append(CopyGuard(module, self.handle.plain_copy))
        for wrapper in wrappers:
            self._hooks.append(wrapper)  # before it changes the module: an interrupt then is undone too
            wrapper.install()

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks[-1].remove()  # then dropped: an interrupted removal is done again (it can be)
            self._hooks.pop()

    def instrumented(self, on: bool) -> None:
        """Take the wrappers off (False) or put them back (True), nothing else changing."""
        if on and not self._hooks:
            self._instrument()
        elif not on:
            self._remove_hooks()

    @torch.inference_mode(False)  # a lazy re-pack inside the user's inference_mode builds ordinary tensors
    def repack(self, apply: Callable[[], None] | None = None, collective: bool = False) -> None:
        """Disable, run ``apply`` on the ordinary model (a dtype change), pack again from what the
        model holds now. If packing again fails, the part stays disabled and the error says so.
        ``collective``: every rank of a part offloaded across ranks re-packs at this point, inside
        the ranks' agreement (which a part refuses otherwise, ``repack_refusal``)."""
        if self._no_repack is not None:
            raise changed_during_call(self, self._no_repack)
        refusal = None if collective else self.repack_refusal()
        if refusal is not None:
            raise refusal
        handle = self.handle
        with changes.repacking(handle) if handle is not None else contextlib.nullcontext():
            self.disable()
            try:
                if apply is not None:
                    apply()
            finally:
                try:
                    self._split_units()
                    with Transaction() as txn:
                        if handle is not None:
                            handle.place(self, txn)  # the new units need homes
                        else:
                            self.placement = None  # the default placement, made by enable
                        self.enable(txn)
                except BaseException as exc:
                    raise RepackError(
                        f"re-packing {self.describe()} after its structure changed failed ({exc!r}); its "
                        "offloading is now off and its weights are ordinary host tensors"
                    ) from exc

    def reconcile(self, replaced: Iterable[tuple[Any, list[torch.Tensor]]]) -> None:
        """Before the part's modules run: ``replaced`` yields (unit, views it should show) for each
        unit whose owners no longer all show their views. A parameter given new data or a buffer
        replaced, of the same shape, strides and dtype, has the value copied home (:func:`adopt_foreign`);
        anything else, or a module or tensor added since the last use (``dirty``), re-packs."""
        structural = self.dirty
        for unit, views in replaced:
            structural |= adopt_foreign(self.backend, unit, views)
        if structural:
            logger.info("the structure of %s changed while offloaded: packing it again", self.describe())
            self.dirty = False
            self.repack()

    def repack_refusal(self) -> Exception | None:
        """Why this part cannot be packed again on its own (None: it can)."""
        return None

    def _split_units(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


def blocks_now(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """A streamed model's blocks when it is packed again: by their names (a block replaced by a
    new module is picked up), or found afresh when a name is gone (the block list was shortened
    or moved: ``model.blocks = model.blocks[:2]``)."""
    try:
        return [(name, model.get_submodule(name)) for name in names]
    except AttributeError:
        from ..discovery import find_blocks

        found = find_blocks(model)
        if not found:
            raise
        return found


def changed_during_call(part: Part, during: str) -> Exception:
    """The error for a structural change (a new Parameter, a module added) made once a call of
    the model had begun, ``during`` what: the call's blocks are bound already, so it cannot be
    re-packed around them. The part re-packs before the next call."""

    part.dirty = True
    return OffloadedModelError(
        f"{during} changed the structure of {part.describe()} (a new Parameter, another shape or dtype, a module "
        "added) after its offloaded forward had begun; make that change before calling the model (the next call "
        "re-packs it), or call handle.disable() first"
    )


def write_back(backend, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(host, device)`` pair to the host once the compute issued so far is done, and
    return when the copies have landed. Rare (only when a forward changed weights or buffers), so
    the host waits rather than tracking the copies."""
    stream = backend.current_stream()
    device_type = backend.device().type
    with backend.batch(stream):
        for dst, src in pairs:
            if src.device.type != device_type:
                dst.copy_(src)  # a tensor the user put on the host: no device involved
            else:
                backend.copy_async(dst, src, stream)
    done = backend.new_event()
    done.record(stream)
    done.synchronize()


def adopt_foreign(backend, unit, views: list[torch.Tensor]) -> bool:
    """Owners of ``unit`` that no longer show their view in ``views``: a parameter given new data
    or a buffer replaced, of the same shape, strides and dtype, has the value copied into the view
    and shows the view again. Returns True if an owner holds anything else (a new Parameter object,
    another shape, strides or dtype): the unit must be packed again, from what the model holds, so
    that it computes with the layout the model now has."""
    structural = False
    adopted = []
    for index, owner in unit.foreign(views):
        current, view = owner.get(), views[index]
        if owner.param is not None and current is not owner.param:
            structural = True
        elif current is not None and same_layout(current, view):
            adopted.append((view, current.data if owner.param is not None else current, owner))
        else:
            structural = True
    if adopted:
        write_back(backend, [(view, value) for view, value, _ in adopted])
        for view, _, owner in adopted:
            owner.rebind(view)
    return structural


class CopyGuard:
    """Makes ``copy.deepcopy`` and pickling of a wrapped module (or a pipeline given its subclass)
    produce an ordinary, un-offloaded copy with the true weights, through ``copier(obj, memo)``:
    otherwise the copy would share this library's wrappers, whose closures point at the original
    model.
    ``copy.copy`` asks for the same ``__reduce_ex__`` and gets what it gets without offload: a
    shallow copy sharing the original's submodules and weights (offloaded with them), less the
    guard and the call wrapper, which are bound to the original. Instance attributes, so the
    object's class stays untouched; ``remove()`` takes them away."""

    def __init__(self, obj: Any, copier: Callable[[Any, dict], Any]) -> None:
        self.obj = obj
        self.copier = copier

    def install(self) -> None:
        """Guard the object (apart from the constructor, as :meth:`CallWrapper.install`)."""
        obj, copier = self.obj, self.copier

        def deepcopy(memo: dict) -> Any:
            return copier(obj, memo)

        def reduce_ex(protocol: int) -> Any:
            if sys._getframe(1).f_code is copy.copy.__code__:
                return shallow_reduction(obj)
            return copier(obj, {}).__reduce_ex__(protocol)

        obj.__dict__["__deepcopy__"] = deepcopy
        obj.__dict__["__reduce_ex__"] = reduce_ex

    def remove(self) -> None:
        self.obj.__dict__.pop("__deepcopy__", None)
        self.obj.__dict__.pop("__reduce_ex__", None)


#: what this library puts in a wrapped object's ``__dict__`` (guard, call wrapper)
BOUND_TO_ORIGINAL = ("__deepcopy__", "__reduce_ex__", "_compiled_call_impl", "compile")


def shallow_reduction(obj: Any) -> tuple:
    """``copy.copy``'s reduction of ``obj`` as without offload: its class and a copy of its
    ``__dict__``, less what this library put there bound to ``obj`` itself."""
    state = {
        key: value for key, value in obj.__dict__.items()
        if key not in BOUND_TO_ORIGINAL and getattr(value, "__self__", None) is not obj
    }
    return copyreg.__newobj__, (type(obj),), state
