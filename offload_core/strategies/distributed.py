"""Distributed layerwise offloading: layerwise streaming across ranks with a fixed two-block
device buffer, and optionally each rank holding only 1/N of every block's host weights.

A distributed part is a layerwise part (layerwise.py) with a transport that knows its ranks: the
sharded gather (gather.py) when ``shard_host_weights`` and more than one rank, else a plain copy.
Either way its copies run on the one copy stream every distributed part of the process shares, a
structural change is refused rather than re-packed (re-packing alone would leave the ranks out of
step), and ``enable`` ends with an :class:`Agreement`: every rank reports whether it succeeded and
what it packed (block count, sizes, dtypes and, when sharded, a fingerprint of each block's
weights); unless all succeeded with the same packing, every rank rolls back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import torch.distributed as dist
from torch import nn

from ..device.backend import DeviceBackend
from ..base.errors import DistributedOffloadError
from .gather import ShardedGather
from .homes import RankHomePolicy, ShardHomePolicy
from .layerwise import LayerwiseOffload
from .transport import RankCopy

#: serial numbers of the distributed parts enabled in this process; ranks enable in step, so the
#: same model gets the same number on every rank and headers of two models cannot pair up
_serials = {"next": 0}


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The process group a distributed part runs across."""

    group: Any
    world: int
    rank: int

    @classmethod
    def of(cls, process_group: Any) -> "Ranks":
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "distributed layerwise offload needs an initialised torch.distributed process group "
                "(backend.init_process_group(rank, world_size, init_method) or torch.distributed.init_process_group)"
            )
        return cls(process_group, dist.get_world_size(process_group), dist.get_rank(process_group))


def distributed_part(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    backend: DeviceBackend,
    process_group: Any = None,
    shard_host_weights: bool = True,
    resident_blocks: Sequence[int] = (),
) -> LayerwiseOffload:
    """A layerwise part across the ranks of ``process_group``: two slots (prefetch depth 1)."""
    ranks = Ranks.of(process_group)
    if shard_host_weights and ranks.world > 1:
        policy = ShardHomePolicy(ranks)
        transport = ShardedGather(ranks, policy)
    else:
        policy, transport = RankHomePolicy(ranks), RankCopy()
    return LayerwiseOffload(model, blocks, backend, 1, transport, resident_blocks, policy)


def agreement(config: Any) -> "Agreement | contextlib.AbstractContextManager":
    """The :class:`Agreement` that ends a distributed enable; for other strategies (or without a
    process group, which the strategy itself reports) a context that agrees with anything."""
    if config.strategy == "distributed" and dist.is_available() and dist.is_initialized():
        return Agreement(config.process_group)
    return _Alone()


class _Alone(contextlib.nullcontext):
    parts: list = []

    def __enter__(self) -> "_Alone":
        return self


class Agreement:
    """The end of a distributed ``enable``, on every rank: all ranks report success or failure
    and their packing; unless every rank succeeded with the same packing, every rank raises (and
    its enable transaction rolls back). A context manager around the enable, so that a rank that
    fails still takes part and the others do not wait for it until the collective timeout."""

    def __init__(self, process_group: Any) -> None:
        self.group = process_group
        self.parts: list = []

    def __enter__(self) -> "Agreement":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        ranked = [p for p in self.parts if getattr(getattr(p, "home_policy", None), "ranks", None)]
        mine = {
            "rank": dist.get_rank(self.group),
            "ok": exc_type is None,
            "error": f"{exc_type.__name__}: {exc}" if exc_type is not None else "",
            "layout": [p.home_policy.layout(p.strategy) for p in ranked] if exc_type is None else None,
        }
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if exc_type is not None:
            return False  # this rank's own error propagates; its enable rolls back
        failed = [r for r in everyone if not r["ok"]]
        if failed:
            raise DistributedOffloadError(
                "distributed offload failed to enable on "
                + "; ".join(f"rank {r['rank']} ({r['error']})" for r in failed)
                + ": rolled back on every rank"
            )
        differing = [r["rank"] for r in everyone if r["layout"] != mine["layout"]]
        if differing:
            raise DistributedOffloadError(
                f"ranks {differing} packed the model differently from rank {mine['rank']} (block count, sizes, "
                "dtypes or, with sharded host weights, the weights themselves): every rank must offload the same "
                "model with the same weights; rolled back on every rank"
            )
        for k, part in enumerate(ranked):
            if part.transport.pairing is not None:
                part.transport.pairing.agreed(_serials["next"] + k)
        _serials["next"] += len(ranked)
        return False
