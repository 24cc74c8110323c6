"""Every exception offload-core raises, in one module that imports nothing of the library: any
layer can raise any of them without importing a layer above it (the handle, a strategy)."""

from __future__ import annotations


class OffloadConfigError(ValueError):
    """An offload option is invalid; the message names the option and the accepted values."""


class CheckpointError(OffloadConfigError):
    """A checkpoint ``offload_core.from_pretrained`` refuses before anything is built from it or
    enabled: a safetensors header that breaks the format's rules, a shard index or folder entry
    naming a file outside the model folder, a config naming something that is not a model class.
    The message names the file and, where one tensor is at fault, the tensor. An
    :class:`~offload_core.OffloadConfigError`, as every invalid input is."""


class BackendNotFoundError(OffloadConfigError, LookupError):
    """A backend name that no plugin registered (or no backend available to auto-detection).
    An :class:`~offload_core.OffloadConfigError`, as every invalid option is."""


class BackendUnavailableError(RuntimeError):
    """An accelerator backend was instantiated in a process where its ``probe()`` is false.

    Raised at construction rather than at first use, so ``get_backend("cuda")`` on a machine
    without a GPU fails with the reason instead of a vendor error deep inside a strategy.
    """


class BlockDiscoveryError(ValueError):
    """No block stack could be found, or a declared one does not exist on the model."""


class UnsupportedTensorError(TypeError):
    """A tensor the packer cannot move faithfully (a meta or sparse tensor, mixed-dtype aliasing)."""


class Unstreamable(TypeError):
    """A tensor subclass whose memory the packer cannot reach; the message says why."""


class AlreadyEnabledError(RuntimeError):
    """``enable_offload`` on a target that already has offloading enabled, or that contains, or is
    contained in, an offloaded model or pipeline; the message names the handle."""


class OffloadedModelError(RuntimeError):
    """An operation an offloaded model refuses before changing anything (moving its weights to
    another device, changing the structure of a model offloaded across ranks); the message names
    ``handle.disable()``."""


class ExportError(RuntimeError):
    """``torch.export`` of an offloaded model; the message names ``handle.disable()``."""


class RepackError(RuntimeError):
    """Packing a model again after a structural change failed; that part is no longer offloaded."""


class DistributedOffloadError(RuntimeError):
    """The ranks of a distributed offload disagree (enable failed on a rank, different weights,
    a gather that paired different blocks, a rank that failed during a forward)."""


class StagingError(RuntimeError):
    """Reading weights into the bounce ring failed on the stager thread."""
