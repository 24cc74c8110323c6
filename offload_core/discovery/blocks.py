"""Which attributes of a model hold its block stacks.

Lookup order: a ``offload_core_blocks`` class attribute (for model authors), then the registry
(``register_blocks``, keyed by class or qualified class name, searched along the MRO so that
subclasses inherit), then a fallback that picks the module lists holding most parameters and
logs what it picked. Blocks run in the order the attributes are listed.
"""

from __future__ import annotations

import logging
from typing import Iterable

from torch import nn

logger = logging.getLogger(__name__)

CLASS_ATTRIBUTE = "offload_core_blocks"
FALLBACK_SHARE = 0.2  # a module list joins the fallback pick if it holds this share of the parameters

_registry: dict[str, tuple[str, ...]] = {}


class BlockDiscoveryError(ValueError):
    """No block stack could be found, or a declared one does not exist on the model."""


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


def fallback_attrs(model: nn.Module) -> tuple[str, ...]:
    """The module lists (outside other module lists, >= 2 entries) holding most parameters."""
    candidates: list[tuple[str, int]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            inside.append(name)
            candidates.append((name, _params(module)))
    if not candidates:
        children = ", ".join(f"{n} ({type(m).__name__})" for n, m in model.named_children()) or "none"
        raise BlockDiscoveryError(
            f"found no block stack in {type(model).__name__}: no nn.ModuleList with two or more entries. "
            f"Declare one with offload_core.register_blocks({type(model).__name__!r}, [...]); children: {children}"
        )
    largest = max(n for _, n in candidates)
    picked = tuple(name for name, n in candidates if n >= FALLBACK_SHARE * largest and n > 0) or (candidates[0][0],)
    logger.info("no blocks declared for %s; streaming the largest module lists: %s",
                type(model).__name__, ", ".join(picked))
    return picked


def find_blocks(model: nn.Module, attrs: Iterable[str] | None = None) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` for every block of ``model``, in execution order."""
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
