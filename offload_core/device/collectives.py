"""torch.distributed calls shared by every backend, across the torch versions we support."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Gather every rank's ``input`` into ``output`` in rank order (``world_size * input.numel()``).

    By the first name this torch has: ``all_gather_single`` (torch 2.13 renamed
    ``all_gather_into_tensor`` to it and deprecated the old name), ``all_gather_into_tensor``
    (torch 2.6 to 2.12), else ``all_gather`` into a list of views of ``output``, which every
    collective library implements. Looked up at each call, so that a test can stand in a
    ``torch.distributed`` with only the names a given version has. One-byte floats (float8, the
    storage of diffusers' layerwise casting) are gathered as their bytes: a gather moves bytes,
    and gloo knows no float8 dtype.
    """
    if input.dtype.is_floating_point and input.dtype.itemsize == 1:
        output, input = output.view(torch.uint8), input.view(torch.uint8)
    single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if single is not None:
        return single(output, input, group=group, async_op=async_op)
    parts = list(output.view(-1).chunk(dist.get_world_size(group)))
    return dist.all_gather(parts, input.view(-1), group=group, async_op=async_op)


def init_process_group(dist_backend: str, rank: int, world_size: int, init_method: str, **kwargs: Any) -> None:
    """Join the default group unless this process already has one of the same backend and size.

    ``timeout`` (a ``datetime.timedelta`` or seconds) bounds how long a collective waits for the
    other ranks; without it torch's default for ``dist_backend`` applies (10 minutes for NCCL, 30
    for gloo in torch 2.13). A short default would fire while ranks pack a large model at
    different speeds before their first collective.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists; "
                f"cannot join as rank {rank} of {world_size}"
            )
        return
    if "timeout" in kwargs:
        kwargs["timeout"] = collective_timeout(kwargs["timeout"])
    dist.init_process_group(dist_backend, rank=rank, world_size=world_size, init_method=init_method, **kwargs)


def collective_timeout(value: Any) -> datetime.timedelta:
    """``value`` (a timedelta or a number of seconds) as the positive timedelta torch wants."""
    if isinstance(value, datetime.timedelta):
        timeout = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        timeout = datetime.timedelta(seconds=value)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got {value!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value!r}")
    return timeout
