"""What the planner knows of a component, and how a device budget is read.

Everything here is plain numbers: a :class:`Component` is built from a torch module by
:mod:`.modules`, from a meta-device config by :mod:`.realsize`, or by hand in a test, and the
planner never touches a tensor.
"""

from __future__ import annotations

import dataclasses
from ..common.config import parse_budget
from ..base.errors import OffloadConfigError

KINDS = ("dit", "text_encoder", "vae", "other")


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The shape of the call a plan is made for: the image or video size (None: the pipeline's
    default), the batch (images per prompt), and the text tokens an encoder reads."""

    height: int | None = None
    width: int | None = None
    frames: int = 1
    batch: int = 1
    text_tokens: int = 512

    def describe(self) -> str:
        frames = f" x {self.frames} frames" if self.frames > 1 else ""
        batch = f", batch {self.batch}" if self.batch > 1 else ""
        return f"{self.width}x{self.height}{frames}{batch}"


@dataclasses.dataclass(frozen=True)
class Component:
    """One weight-holding component of a pipeline (or a bare model, as one component).

    ``resident_bytes``: its weights outside the blocks (embeddings, norms, heads), which stay on
    the device whenever it is there. ``block_bytes``: each block's weights, in execution order (empty
    when it has no block stack). ``activation_bytes``: the device memory one forward needs besides
    the weights; None until measured or given, when :attr:`activation` estimates it.
    ``copy_bandwidth``: host-to-device bytes per second; ``block_compute_s``: seconds one block's
    forward takes on the device (one value, or one per block); either may be None (unknown), and
    the plan then predicts less (see :mod:`.plan`). ``unit_bytes``: the bytes of the whole
    component packed as one unit, which is how it is kept resident, staged or swapped (its
    alignment padding differs from the resident part's and the blocks' added up); None: that sum.
    ``activation_from``: where ``activation_bytes`` comes from (see :attr:`activation_source`).
    """

    name: str
    kind: str
    resident_bytes: int
    block_bytes: tuple[int, ...] = ()
    activation_bytes: int | None = None
    copy_bandwidth: float | None = None
    block_compute_s: float | tuple[float, ...] | None = None
    unit_bytes: int | None = None
    activation_from: str = "given"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.resident_bytes < 0 or any(b < 0 for b in self.block_bytes):
            raise ValueError(f"{self.name}: byte counts must be >= 0")
        object.__setattr__(self, "block_bytes", tuple(int(b) for b in self.block_bytes))

    @property
    def total_bytes(self) -> int:
        """Its weights on the device when it is there whole (resident, staged or swapped)."""
        return self.unit_bytes if self.unit_bytes is not None else self.resident_bytes + sum(self.block_bytes)

    @property
    def activation(self) -> int:
        """The activation headroom the plan reserves: ``activation_bytes`` when known; else an
        estimate, the bytes of its largest block (the weights one block computes with, a stand-in
        for the intermediates of one block at a typical resolution), or of all its weights when it
        has no blocks. Only a measurement makes it right; the estimate is there so that a plan can
        be made before the first call."""
        if self.activation_bytes is not None:
            return self.activation_bytes
        return max(self.block_bytes) if self.block_bytes else self.total_bytes

    @property
    def activation_source(self) -> str:
        """"given", "config" (estimated from the model's config and the call's shape), "measured",
        or "estimate" (the fallback of :attr:`activation`)."""
        return self.activation_from if self.activation_bytes is not None else "estimate"

    @property
    def streamable(self) -> bool:
        """Whether layerwise offload streams it block by block (a DiT or a text encoder with a
        block stack); other components are staged onto the device around their use."""
        return self.kind in ("dit", "text_encoder") and len(self.block_bytes) > 0

    def with_measurements(self, **values) -> "Component":
        """A copy with ``activation_bytes``, ``copy_bandwidth`` or ``block_compute_s`` replaced."""
        return dataclasses.replace(self, **values)


def device_bytes(value: object, total: int | None = None) -> int:
    """``device_memory`` in bytes: bytes (an int), a size string ("16GiB", "12 GB"), or a
    fraction of ``total`` (the device's memory, ``backend.mem_get_info()[1]``): a float, or a
    string with a decimal point, in (0, 1]. Read by the one size parser of every option
    (``offload_core.common.config.parse_budget``; the table in docs/index.md)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        raise OffloadConfigError("device_memory= needs a budget: bytes, a size such as '16GiB', or a fraction "
                                 "of the device's memory such as 0.9")
    try:
        parsed = parse_budget(value, of="the device's memory")
    except ValueError as exc:
        raise OffloadConfigError(f"invalid device_memory={value!r}: {exc}") from None
    if parsed.fraction is not None and total is None:
        raise OffloadConfigError(f"device_memory={value!r} is a fraction of the device's memory, which is unknown "
                                 "here: give bytes or a size such as '16GiB'")
    return parsed.resolve(total or 0)
