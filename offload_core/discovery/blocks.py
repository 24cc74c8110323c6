"""Which attributes of a model hold its block stacks.

Lookup order: a ``offload_core_blocks`` class attribute (for model authors), then the registry
(``register_blocks``, keyed by class or qualified class name, searched along the MRO so that
subclasses inherit), then a fallback that picks the module lists holding most parameters and
logs what it picked. Blocks run in the order the attributes are listed.

Before it goes by size, the fallback knows two layouts. Diffusers' U-Nets run their down, mid and
up blocks in that order. Models that expose their token (or patch) embeddings
(``get_input_embeddings()``, as every transformers model does) run the layer stack beside them on
every call: wrapper classes such as ``Mistral3ForConditionalGeneration`` or ``T5EncoderModel`` nest
that decoder / encoder stack a few modules down, beside a vision tower a text prompt never runs.
Finding nothing is not an error here: the caller keeps a model without blocks whole (see
``docs/layerwise.md``).
"""

from __future__ import annotations

import logging
from typing import Iterable

from torch import nn
from ..base.errors import BlockDiscoveryError


logger = logging.getLogger(__name__)

CLASS_ATTRIBUTE = "offload_core_blocks"
FALLBACK_SHARE = 0.2  # a module list joins the fallback pick if it holds this share of the parameters

_registry: dict[str, tuple[str, ...]] = {}


def _key(cls_or_qualname: type | str) -> str:
    if isinstance(cls_or_qualname, str):
        return cls_or_qualname
    return f"{cls_or_qualname.__module__}.{cls_or_qualname.__qualname__}"


def register_blocks(cls_or_qualname: type | str, attrs: str | Iterable[str]) -> None:
    """Declare the block-list attributes of a model class.

    ``cls_or_qualname`` is a class, its qualified name (``"pkg.module.Class"``) or its bare
    class name (``"Class"``, matching any class of that name). ``attrs`` are attribute paths
    (dots allowed) naming ``nn.ModuleList``\\ s (or single modules, streamed as one block), in
    execution order. Registering again replaces the earlier entry.
    """
    attrs = (attrs,) if isinstance(attrs, str) else tuple(attrs)
    if not attrs or not all(isinstance(a, str) and a for a in attrs):
        raise ValueError(f"register_blocks needs one or more attribute names, got {attrs!r}")
    _registry[_key(cls_or_qualname)] = attrs


def registered_blocks() -> dict[str, tuple[str, ...]]:
    """A copy of the registry: class key -> block attributes."""
    return dict(_registry)


def declared_attrs(model: nn.Module) -> tuple[str, ...] | None:
    """The block attributes declared for ``model``'s class, or None."""
    declared = getattr(type(model), CLASS_ATTRIBUTE, None)
    if declared:
        return (declared,) if isinstance(declared, str) else tuple(declared)
    for cls in type(model).__mro__:
        for key in (_key(cls), cls.__name__):
            if key in _registry:
                return _registry[key]
    return None


def _resolve(model: nn.Module, path: str) -> nn.Module:
    obj = model
    for part in path.split("."):
        if not isinstance(obj, nn.Module) or not hasattr(obj, part):
            raise BlockDiscoveryError(
                f"{type(model).__name__} declares block attribute {path!r}, but it has no {part!r}; "
                f"its children are: {', '.join(n for n, _ in model.named_children()) or 'none'}"
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Module):
        raise BlockDiscoveryError(f"{type(model).__name__}.{path} is a {type(obj).__name__}, not a module")
    return obj


def _is_absent(model: nn.Module, path: str) -> bool:
    """True when a declared attribute exists but is None (e.g. a UNet configured without a mid block)."""
    obj: object = model
    for part in path.split("."):
        if not hasattr(obj, part):
            return False  # missing altogether: _resolve reports it
        obj = getattr(obj, part)
    return obj is None


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _module_lists(scope: nn.Module) -> list[tuple[str, int]]:
    """(path, parameters) of the non-empty module lists in ``scope`` that are not inside another,
    in registration order."""
    found: list[tuple[str, int]] = []
    for name, module in scope.named_modules():
        if any(name.startswith(p + ".") for p, _ in found):
            continue
        if isinstance(module, nn.ModuleList) and len(module) and name:
            found.append((name, _params(module)))
    return found


def _stacks_in(scope: nn.Module) -> tuple[str, ...]:
    """The outermost module lists of ``scope`` holding at least ``FALLBACK_SHARE`` of the largest
    one's parameters. A one-entry list counts (a one-layer model), so that the lists inside its
    one block (an attention's ``to_out``) are not taken for the stack."""
    candidates = _module_lists(scope)
    largest = max((n for _, n in candidates), default=0)
    return tuple(name for name, n in candidates if n > 0 and n >= FALLBACK_SHARE * largest)


def _embedding_scope(model: nn.Module) -> str | None:
    """Path of the innermost module around the model's input embeddings that holds a module list
    ("" for the model itself), or None when the model exposes no embeddings."""
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        return None
    try:
        embeddings = getter()
    except Exception:  # noqa: BLE001 - some classes raise NotImplementedError: no rule to apply then
        return None
    path = next((n for n, m in model.named_modules() if m is embeddings), None) if isinstance(embeddings, nn.Module) else None
    if path is None:
        return None
    parts = path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:depth])
        if _module_lists(model.get_submodule(prefix)):
            return prefix
    return None


def _unet_layout(model: nn.Module) -> tuple[str, ...]:
    """``down_blocks``, ``mid_block``, ``up_blocks`` when the model has diffusers' U-Net layout, in
    the order they run (the largest-lists rule would take the mid block's inner lists apart and
    put them after the up blocks)."""
    if not all(isinstance(getattr(model, a, None), nn.ModuleList) for a in ("down_blocks", "up_blocks")):
        return ()
    mid = ("mid_block",) if isinstance(getattr(model, "mid_block", None), nn.Module) else ()
    return ("down_blocks", *mid, "up_blocks")


def fallback_attrs(model: nn.Module) -> tuple[str, ...]:
    """A U-Net's down, mid and up blocks, else the stack next to the input embeddings, else the
    largest module lists of the model; empty when the model has no module list at all."""
    picked, rule = _unet_layout(model), "its U-Net blocks"
    if not picked:
        scope = _embedding_scope(model)
        if scope is not None:
            picked = tuple(f"{scope}.{name}" if scope else name for name in _stacks_in(model.get_submodule(scope)))
            rule = "the layer stack beside its input embeddings"
        else:
            picked, rule = _stacks_in(model), "the largest module lists"
    if picked:
        logger.info("no blocks declared for %s; streaming %s: %s", type(model).__name__, rule, ", ".join(picked))
    return picked


def no_blocks_hint(model: nn.Module) -> str:
    """How to declare ``model``'s blocks, with its children to choose from: the second half of
    the line a caller logs when it keeps a model without blocks whole."""
    name = type(model).__name__
    children = ", ".join(f"{n} ({type(m).__name__})" for n, m in model.named_children()) or "none"
    return f"declare its blocks with offload_core.register_blocks({name!r}, [...]) (children: {children})"


def find_blocks(model: nn.Module, attrs: Iterable[str] | None = None) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` for every block of ``model``, in execution order; empty when
    the model has no block stack (the declared lists are empty or None, or there is none to find).
    A declared attribute that does not exist is a :class:`BlockDiscoveryError`."""
    attrs = tuple(attrs) if attrs is not None else (declared_attrs(model) or fallback_attrs(model))
    blocks: list[tuple[str, nn.Module]] = []
    for path in attrs:
        if _is_absent(model, path):
            logger.debug("%s has %s = None (an optional part of its config); nothing to stream there",
                         type(model).__name__, path)
            continue
        found = _resolve(model, path)
        if isinstance(found, (nn.ModuleList, nn.Sequential)):
            blocks.extend((f"{path}.{i}", b) for i, b in enumerate(found))
        else:
            blocks.append((path, found))
    seen: set[int] = set()
    for name, block in blocks:
        if id(block) in seen:
            raise BlockDiscoveryError(f"{type(model).__name__}: block {name} is listed twice")
        seen.add(id(block))
    return blocks
