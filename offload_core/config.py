"""OffloadConfig: the user's choices, validated, with the strategy flags' priority applied."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Sequence

from .hostmem.budget import Budget, parse_budget

#: strategy flags, highest priority first, and the strategy each selects
FLAG_PRIORITY = (
    ("enable_distributed_layerwise_offload", "distributed"),
    ("enable_layerwise_offload", "layerwise"),
    ("enable_cpu_offload", "model"),
)
#: pipeline component groups a strategy can offload
COMPONENT_GROUPS = ("dit", "text_encoder", "vae")


class OffloadConfigError(ValueError):
    """An offload option is invalid; the message names the option and the accepted values."""


@dataclasses.dataclass
class OffloadConfig:
    """Everything ``enable_offload`` accepts besides the target. See ``docs/index.md``.

    ``components`` (pipelines, layerwise only): the groups whose weights stream, of
    ``"dit"``, ``"text_encoder"``, ``"vae"``; default ``("dit",)``. ``blocks``: block attribute
    names overriding discovery for a bare module.

    ``pinned_memory`` / ``host_memory``: budgets for page-locked memory and for weights in RAM at
    all (bytes, ``"12GiB"``, a fraction of RAM, or None / ``"auto"``); blocks beyond
    ``host_memory`` are read from disk, from the checkpoint (``from_pretrained``) or from
    ``offload_folder``, where an already-loaded model's blocks are spilled. See
    ``docs/bigger-than-ram.md``.
    """

    enable_cpu_offload: bool = False
    enable_layerwise_offload: bool = False
    enable_distributed_layerwise_offload: bool = False
    backend: Any = None
    pin_memory: bool = True
    prefetch_depth: int = 1
    process_group: Any = None
    shard_host_weights: bool = True
    components: Sequence[str] | None = None
    blocks: Sequence[str] | None = None
    pinned_memory: Any = None
    host_memory: Any = None
    offload_folder: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        for flag, _ in FLAG_PRIORITY:
            if not isinstance(getattr(self, flag), bool):
                raise OffloadConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1:
            raise OffloadConfigError(f"prefetch_depth must be an integer >= 1, got {self.prefetch_depth!r}")
        if self.components is not None:
            if isinstance(self.components, str):
                self.components = (self.components,)
            unknown = [c for c in self.components if c not in COMPONENT_GROUPS]
            if unknown or not self.components:
                raise OffloadConfigError(
                    f"unknown component group(s) {unknown or list(self.components)}; choose from {', '.join(COMPONENT_GROUPS)}"
                )
            self.components = tuple(dict.fromkeys(self.components))
        if self.blocks is not None:
            self.blocks = (self.blocks,) if isinstance(self.blocks, str) else tuple(self.blocks)
        self._check_host_memory()

    def _check_host_memory(self) -> None:
        for option in ("pinned_memory", "host_memory"):
            try:
                parse_budget(getattr(self, option), option)
            except ValueError as exc:
                raise OffloadConfigError(str(exc)) from None
        if not self.pin_memory and not self.pinned_budget.auto:
            raise OffloadConfigError(
                f"pinned_memory={self.pinned_memory!r} is a budget for pinned memory, but pin_memory=False pins "
                "nothing; set one or the other"
            )
        if not self.host_budget.auto and self.strategy in ("model", "distributed"):
            raise OffloadConfigError(
                f"host_memory= (blocks read from disk) applies to layerwise offload, not to {self.strategy} offload"
            )
        if self.offload_folder is not None and not isinstance(self.offload_folder, (str, os.PathLike)):
            raise OffloadConfigError(f"offload_folder must be a path, got {type(self.offload_folder).__name__}")

    @property
    def pinned_budget(self) -> Budget:
        return parse_budget(self.pinned_memory, "pinned_memory")

    @property
    def host_budget(self) -> Budget:
        return parse_budget(self.host_memory, "host_memory")

    @property
    def strategy(self) -> str | None:
        """The selected strategy ("distributed" > "layerwise" > "model"), or None if no flag is set."""
        for flag, strategy in FLAG_PRIORITY:
            if getattr(self, flag):
                return strategy
        return None

    def ignored_flags(self) -> list[str]:
        """Flags that are set but lose to a higher-priority one."""
        set_flags = [flag for flag, _ in FLAG_PRIORITY if getattr(self, flag)]
        return set_flags[1:]

    def warn_ignored(self) -> None:
        ignored = self.ignored_flags()
        if ignored:
            chosen = next(flag for flag, _ in FLAG_PRIORITY if getattr(self, flag))
            message = f"offload flags are mutually exclusive: {chosen} wins; ignoring {', '.join(ignored)}"
            warnings.warn(message, UserWarning, stacklevel=3)
