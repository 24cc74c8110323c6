"""OffloadConfig: the user's choices, validated, with the strategy flags' priority applied."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

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
