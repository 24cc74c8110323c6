"""OffloadConfig: the user's choices, validated in one place, with the strategy flags' priority applied.

Every option is a field declared with :func:`option`, which names the function that checks (and
normalises) its value and the strategies and targets it applies to. So a new option is one field:
``__post_init__`` type-checks every value, and :meth:`OffloadConfig.check_applies` rejects an
option set for a target or strategy it does not apply to (or warns, when another strategy flag
that would have used it lost to a higher-priority one). Every problem is an
:class:`OffloadConfigError` that names the option; a backend's own options use :func:`check_value`
to fail the same way.
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import re
import warnings
from typing import Any, Callable, Sequence, TypeVar
from ..base.errors import OffloadConfigError


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One strategy, as every layer names it: ``name`` in plans, ``handle.strategy`` and the
    command's ``--strategy``; ``flag``, the ``enable_offload`` option that selects it (None for
    "resident", which a device plan picks when everything fits, and which offloads nothing);
    ``words``, how a sentence names it ("<words> offload")."""

    name: str
    flag: str | None
    words: str

    @property
    def phrase(self) -> str:
        """What a plan's text calls it."""
        return f"{self.words} offload" if self.flag is not None else "no offload (everything resident)"


#: every strategy by name; those with a flag first, highest flag priority first
STRATEGIES = {s.name: s for s in (
    Strategy("distributed", "enable_distributed_layerwise_offload", "distributed layerwise"),
    Strategy("layerwise", "enable_layerwise_offload", "layerwise"),
    Strategy("model", "enable_cpu_offload", "model-level"),
    Strategy("resident", None, "no"),
)}
#: the strategies a flag selects, highest priority first
FLAGGED = tuple(s for s in STRATEGIES.values() if s.flag is not None)
#: what ``enable_offload`` can offload
TARGETS = ("pipeline", "module")
TARGET_WORDS = {"pipeline": "a diffusers pipeline", "module": "a bare torch.nn.Module"}
#: pipeline component groups a strategy can offload
COMPONENT_GROUPS = ("dit", "text_encoder", "vae")
OPTION = "offload_core.option"


# -- value parsers: each takes a value, returns it normalised, or raises ValueError / TypeError ----


def boolean(value: Any) -> bool:
    """True or False, nothing else: ``pin_memory="no"`` would read as yes."""
    if isinstance(value, bool):
        return value
    raise TypeError("expected True or False")


def count(minimum: int = 0) -> Callable[[Any], int]:
    """An integer >= ``minimum``."""

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def names(choices: Sequence[str] | None = None) -> Callable[[Any], tuple[str, ...]]:
    """One name or a sequence of names (non-empty strings), from ``choices`` when given; as a tuple
    without repeats."""

    def parse(value: Any) -> tuple[str, ...]:
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise TypeError(f"expected a name or a non-empty list of names, got {value!r}")
        bad = [item for item in items if not isinstance(item, str) or not item]
        if bad:
            raise TypeError(f"expected names (non-empty strings), got {bad[0]!r}")
        unknown = [item for item in items if choices is not None and item not in choices]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices or ())}")
        return tuple(dict.fromkeys(items))

    return parse


def _backend(value: Any) -> Any:
    from ..device.backend import DeviceBackend

    if value is None or isinstance(value, (str, DeviceBackend)):
        return value
    raise TypeError(f"expected None, a registered backend name or a DeviceBackend instance, got {type(value).__name__}")


def _process_group(value: Any) -> Any:
    import torch.distributed as dist

    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return value
    raise TypeError(f"expected None (the world group) or a torch.distributed.ProcessGroup, got {type(value).__name__}")


def _path(value: Any) -> str | os.PathLike:
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return value
    raise TypeError(f"expected a folder path, got {type(value).__name__}")


def storage_dtype(value: Any) -> Any:
    """A floating ``torch.dtype`` (``torch.float8_e4m3fn``): the dtype the DiTs' weights are stored
    and streamed in; whether it is narrower than the weights is checked against the model."""
    import torch

    if not isinstance(value, torch.dtype):
        raise TypeError(f"expected a torch.dtype such as torch.float8_e4m3fn, got {type(value).__name__}")
    if not value.is_floating_point:
        raise ValueError("expected a floating dtype (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, ...)")
    return value


def _optional(parse: Callable[[Any], T]) -> Callable[[Any], T | None]:
    return lambda value: None if value is None else parse(value)


# -- sizes and budgets -----------------------------------------------------------------------
# One parser for every size an option or a command-line flag takes (the table in docs/index.md):
# bytes as an ``int``; a string, a number with a unit spelled exactly as below; a fraction of RAM
# or of the device's memory (a ``float``, or a string with a decimal point, in (0, 1]) where the
# option takes one; ``None`` / ``"auto"`` for the documented default. A string means the same in
# the API and on the command line. Ambiguous spellings are refused with the unambiguous ones:
# "24G" is 24 GiB to docker and Java but 24e9 bytes to Kubernetes, a lower-case "b" is a bit, and
# "24" could be bytes or gigabytes.

UNITS = {
    "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_PREFIXES = "KMGT"


class Budget:
    """A parsed budget: ``nbytes`` or ``fraction`` of RAM, or neither for "auto"."""

    __slots__ = ("nbytes", "fraction")

    def __init__(self, nbytes: int | None = None, fraction: float | None = None) -> None:
        self.nbytes = nbytes
        self.fraction = fraction

    @property
    def auto(self) -> bool:
        return self.nbytes is None and self.fraction is None

    def resolve(self, physical: int) -> int | None:
        """Bytes on a machine with ``physical`` bytes of RAM, or None for "auto" (the caller
        applies its own default)."""
        if self.nbytes is not None:
            return self.nbytes
        if self.fraction is not None:
            return int(self.fraction * physical)
        return None

    def __repr__(self) -> str:
        if self.auto:
            return "Budget(auto)"
        return f"Budget({self.nbytes} bytes)" if self.nbytes is not None else f"Budget({self.fraction:g} of RAM)"


def host_budget_option(value: object) -> object:
    """The option parser of a host budget (``pinned_memory``, ``host_memory``): ``value`` itself, once :func:`parse_budget` accepts it."""
    parse_budget(value)
    return value


def device_budget_option(value: object) -> object:
    """The option parser of ``device_memory``: a budget whose fraction is of the device's memory."""
    parse_budget(value, of="the device's memory")
    return value


def size(value: object) -> int:
    """Bytes, or a size string: ``activation_memory`` (no fraction: activations are not a share
    of anything)."""
    return parse_budget(value, of=None).nbytes


def resident_blocks(value: object) -> int | str:
    """How many blocks stay on the device: an int >= 0, or "auto" (as many as the budget allows)."""
    if value == "auto":
        return value
    return count(0)(value)


def _unit_hint(number: str, unit: str) -> str:
    """What to write instead of ``number`` + ``unit`` (a unit not in :data:`UNITS`)."""
    prefix = unit[:1].upper()
    if prefix in _PREFIXES and unit.lower() in (prefix.lower() + tail for tail in ("", "b", "i", "ib")):
        power = _PREFIXES.index(prefix) + 1
        decimal_unit = ("k" if prefix == "K" else prefix) + "B"
        return (f"{unit!r} is ambiguous (binary or decimal; a lower-case b is a bit): write '{number}{prefix}iB' "
                f"({number} * 2**{10 * power} bytes) or '{number}{decimal_unit}' ({number} * 10**{3 * power} bytes)")
    if unit.lower() in ("b", "byte", "bytes"):
        return f"{unit!r} is not a unit of bytes (a lower-case b is a bit): write '{number}B' for bytes"
    return f"unknown unit {unit!r}; units: {', '.join(UNITS)} (as written here)"


def _size_text(text: str, of: str | None) -> Budget:
    """A string: a number and a unit of :data:`UNITS`, "0", or (where ``of`` names what it is a
    fraction of) a fraction with a decimal point."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError("not a size")
    number, unit = match.groups()
    if unit:
        if unit not in UNITS:
            raise ValueError(_unit_hint(number, unit))
        return Budget(nbytes=int(decimal.Decimal(number) * UNITS[unit]))
    if decimal.Decimal(number) == 0:
        return Budget(nbytes=0)  # zero of any unit
    if "." in number and of is not None:
        return _fraction(float(number), of, text)
    whole = number.rstrip(".")
    hint = f", or '{whole}.0' for all of {of}" if of is not None and decimal.Decimal(number) == 1 else ""
    raise ValueError(f"{text!r} has no unit: write '{whole}GiB' ({whole} * 2**30 bytes), '{whole}GB' "
                     f"({whole} * 10**9 bytes) or '{whole}B' (bytes){hint}")


def _fraction(value: float, of: str, given: object) -> Budget:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"a fraction of {of} is in (0, 1], got {given!r}; give bytes as an int or a size "
                         "such as '12GiB'")
    return Budget(fraction=value)


def parse_budget(value: object, of: str | None = "RAM") -> Budget:
    """``value`` as a :class:`Budget`, or ``ValueError`` saying what is accepted. A fraction is of
    ``of`` ("RAM", "the device's memory"); with ``of`` None the value is a size, and neither a
    fraction nor "auto" is accepted."""
    fraction = f", a fraction of {of} in (0, 1] such as 0.5, or None / 'auto'" if of is not None else ""
    accepted = f"expected bytes (an int >= 0) or a size such as '12GiB' or '512MB'{fraction}"
    if of is not None and (value is None or (isinstance(value, str) and value.strip().lower() == "auto")):
        return Budget()
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{accepted}; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{accepted}; got {value!r}")
        return Budget(nbytes=value)
    if isinstance(value, float) and of is not None:
        return _fraction(value, of, value)
    if isinstance(value, str):
        try:
            return _size_text(value, of)
        except ValueError as exc:
            raise ValueError(f"{accepted}; got {value!r}" if str(exc) == "not a size" else str(exc)) from None
    raise ValueError(f"{accepted}; got {type(value).__name__} {value!r}")


# -- declaring options ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field is checked, and what it applies to."""

    parse: Callable[[Any], Any]
    strategies: tuple[str, ...] = tuple(s.name for s in FLAGGED)
    targets: tuple[str, ...] = TARGETS


def option(
    default: Any,
    parse: Callable[[Any], Any],
    strategies: Sequence[str] = tuple(s.name for s in FLAGGED),
    targets: Sequence[str] = TARGETS,
) -> Any:
    """A field of :class:`OffloadConfig`: its default, its parser, and the strategies and targets it
    applies to (setting it elsewhere is an error, see :meth:`OffloadConfig.check_applies`)."""
    return dataclasses.field(default=default, metadata={OPTION: Option(parse, tuple(strategies), tuple(targets))})


@dataclasses.dataclass
class OffloadConfig:
    """Everything ``enable_offload`` accepts besides the target. See ``docs/index.md``.

    ``components`` (pipelines; layerwise and distributed): the groups whose weights stream, of
    ``"dit"``, ``"text_encoder"``, ``"vae"``; default ``("dit",)``. ``blocks``: block attribute
    names overriding discovery (of a bare module, or of a pipeline's DiTs).

    ``pinned_memory`` / ``host_memory``: budgets for page-locked memory and for weights in RAM at
    all (bytes, ``"12GiB"``, a fraction of RAM, or None / ``"auto"``); blocks beyond
    ``host_memory`` are read from disk, from the checkpoint (``from_pretrained``) or from
    ``offload_folder``, where an already-loaded model's blocks are spilled. See
    ``docs/bigger-than-ram.md``.

    ``device_memory``: a budget for the device (bytes, ``"16GiB"``, a fraction of the device's
    memory). With no strategy flag the planner picks the strategy that fits it; with one, it sizes
    that strategy. ``resident_blocks`` (layerwise, distributed): blocks kept on the device, an int
    or ``"auto"`` (as many as ``device_memory`` allows; the default when it is set).
    ``activation_memory``: the headroom kept within ``device_memory`` for activations; by default
    measured on the first call. See ``docs/index.md`` ("Tell it your memory").

    ``storage_dtype``: a floating dtype narrower than the weights (``torch.float8_e4m3fn``): the DiTs
    get diffusers' layerwise casting (weights stored in it, computed in their own dtype, diffusers'
    default skip patterns), so host homes, copies and slots hold them narrow. See ``docs/float8.md``.
    """

    enable_cpu_offload: bool = option(False, boolean)
    enable_layerwise_offload: bool = option(False, boolean)
    enable_distributed_layerwise_offload: bool = option(False, boolean)
    backend: Any = option(None, _backend)
    pin_memory: bool = option(True, boolean)
    prefetch_depth: int = option(1, count(1), strategies=("layerwise",))
    process_group: Any = option(None, _process_group, strategies=("distributed",))
    shard_host_weights: bool = option(True, boolean, strategies=("distributed",))
    components: Sequence[str] | None = option(
        None, _optional(names(COMPONENT_GROUPS)), strategies=("layerwise", "distributed"), targets=("pipeline",)
    )
    blocks: Sequence[str] | None = option(None, _optional(names()), strategies=("layerwise", "distributed"))
    pinned_memory: Any = option(None, host_budget_option)
    host_memory: Any = option(None, host_budget_option, strategies=("layerwise",))
    offload_folder: str | os.PathLike | None = option(None, _optional(_path), strategies=("layerwise",))
    device_memory: Any = option(None, device_budget_option)
    resident_blocks: int | str | None = option(None, _optional(resident_blocks), strategies=("layerwise", "distributed"))
    activation_memory: int | None = option(None, _optional(size))
    storage_dtype: Any = option(None, _optional(storage_dtype))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, check_value(field.name, getattr(self, field.name), field.metadata[OPTION].parse))
        if self.activation_memory is not None and self.device_budget.auto:
            raise OffloadConfigError(
                f"activation_memory={self.activation_memory!r} is the headroom kept within a device_memory budget; "
                "set device_memory too"
            )
        if not self.pin_memory and not self.pinned_budget.auto:
            raise OffloadConfigError(
                f"pinned_memory={self.pinned_memory!r} is a budget for pinned memory, but pin_memory=False pins "
                "nothing; set one or the other"
            )

    @property
    def pinned_budget(self) -> Budget:
        return parse_budget(self.pinned_memory)

    @property
    def host_budget(self) -> Budget:
        return parse_budget(self.host_memory)

    @property
    def device_budget(self) -> Budget:
        return parse_budget(self.device_memory, of="the device's memory")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "OffloadConfig":
        """The config of ``enable_offload``'s keyword options; unknown names are an error that
        lists the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in options if name not in valid]
        if unknown:
            raise OffloadConfigError(f"unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        return cls(**options)

    @property
    def strategy(self) -> str | None:
        """The selected strategy ("distributed" > "layerwise" > "model"), or None if no flag is set."""
        return next((s.name for s in FLAGGED if getattr(self, s.flag)), None)

    def ignored_flags(self) -> list[str]:
        """Flags that are set but lose to a higher-priority one."""
        set_flags = [s.flag for s in FLAGGED if getattr(self, s.flag)]
        return set_flags[1:]

    def warn_ignored(self) -> None:
        ignored = self.ignored_flags()
        if ignored:
            chosen = next(s.flag for s in FLAGGED if getattr(self, s.flag))
            message = f"offload flags are mutually exclusive: {chosen} wins; ignoring {', '.join(ignored)}"
            warnings.warn(message, UserWarning, stacklevel=3)

    def check_applies(self, target: str) -> None:
        """Every option set to other than its default applies to ``target`` ("pipeline" or
        "module") and to the selected strategy. One that a losing strategy flag would have used is
        warned about (one warning naming all of them); any other is an error."""
        chosen = self.strategy
        losing = [s.name for s in FLAGGED if getattr(self, s.flag) and s.name != chosen]
        unused = []
        for field in dataclasses.fields(self):
            spec: Option = field.metadata[OPTION]
            if field.name.startswith("enable_") or getattr(self, field.name) == field.default:
                continue
            if target not in spec.targets:
                raise OffloadConfigError(
                    f"{field.name}= applies to {' or '.join(TARGET_WORDS[t] for t in spec.targets)}, "
                    f"not to {TARGET_WORDS[target]}"
                )
            if chosen in spec.strategies:
                continue
            if any(strategy in spec.strategies for strategy in losing):
                unused.append(field.name)
                continue
            raise OffloadConfigError(
                f"{field.name}= applies to {' or '.join(STRATEGIES[s].words for s in spec.strategies)} offload, "
                f"not to {STRATEGIES[chosen].words} offload"
            )
        if unused:
            warnings.warn(
                f"{', '.join(name + '=' for name in unused)} ignored: {STRATEGIES[chosen].words} offload, "
                "which wins by flag priority, does not use it",
                UserWarning,
                stacklevel=3,
            )


def check_value(name: str, value: Any, parse: Callable[[Any], T]) -> T:
    """``parse(value)``, or an :class:`OffloadConfigError` naming the option ``name``."""
    try:
        return parse(value)
    except (TypeError, ValueError) as exc:
        raise OffloadConfigError(f"invalid {name}={value!r}: {exc}") from None
