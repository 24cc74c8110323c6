"""Distributed layerwise offloading: layerwise streaming across ranks with a fixed two-block
device buffer, and optionally each rank holding only 1/N of every block's host weights.

With ``shard_host_weights`` each block's per-dtype buffer is padded to a multiple of the world
size and split into N equal shards; rank r keeps shard r in pinned memory. Loading a block copies
this rank's shard into a small staging buffer, then an all-gather on the copy stream rebuilds the
whole block in the slot on every rank. Host memory per rank is then the resident part plus 1/N of
the blocks. Without sharding every rank keeps the whole model and the transport is a plain copy.

Every rank must run the same forwards in the same order (the all-gathers are collective). The
ranks are kept honest rather than trusted:

* ``enable`` ends with an agreement (:class:`Agreement`): every rank reports whether it succeeded
  and what it packed (block count, sizes, dtypes and, when sharded, a fingerprint of each block's
  weights); unless all succeeded with the same packing, every rank rolls back.
* Each sharded load first all-gathers a small header (block index, the part's serial number, a
  status). When a pass ends the host checks every header of the pass: a gather that paired
  different blocks on different ranks raises :class:`DistributedOffloadError` instead of returning
  an output computed on mismatched weights.
* Every pass (and every block called outside a forward) ends with one more header, which says
  whether the rank got through. A rank whose forward fails still issues the gathers of the blocks
  the others will load in that pass and its end header, marked as aborted, so the other ranks
  finish the pass, see the abort and raise too, and the ranks stay in step: the next forward works
  on every rank.
* ``disable`` is collective when sharded: it rebuilds the full host weights on every rank, checks
  every header, and only then gives the weights back; if the ranks are out of step it raises and
  changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..backend import DeviceBackend
from ..errors import DistributedOffloadError
from ..hostmem.placement import ONCE, STREAM, HostUnit, Tier
from ..labels import label
from ..weights import nbytes_of
from .common import Transaction, allocate_device, pack_units
from .layerwise import LayerwiseOffload, placeholders

logger = logging.getLogger(__name__)

#: header of one load: magic, the part's serial number, block index (END for the end of a pass), status
HEADER = 4
MAGIC = 0x0FF10AD
OK, ABORTED = 0, 1
END = -1


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: serial numbers of the distributed parts enabled in this process; ranks enable in step, so the
#: same model gets the same number on every rank and headers of two models cannot pair up
_serials = {"next": 0}


def _rebind_all(originals) -> None:
    for owner, tensor in originals:
        if owner.param is not None and owner.param.is_meta != tensor.is_meta:
            owner.replace(torch.nn.Parameter(tensor, requires_grad=owner.param.requires_grad))
        else:
            owner.rebind(tensor)


def _read_flat(source: torch.Tensor, start: int, count: int, out: torch.Tensor) -> None:
    """A pageable shard read into the bounce ring."""
    out.copy_(source[start : start + count])


def fingerprint(buffers: dict[torch.dtype, torch.Tensor]) -> tuple[int, ...]:
    """A cheap digest of a unit's bytes: sums of its words, and of every other word, per dtype.
    Two ranks holding different weights for one block get different digests."""
    digest = []
    for dtype in sorted(buffers, key=str):
        raw = buffers[dtype].reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        digest += [int(words.sum(dtype=torch.int64)), int(words[::2].sum(dtype=torch.int64))]
    return tuple(digest)


class DistributedLayerwiseOffload(LayerwiseOffload):
    """Two slots, each the largest block padded to a multiple of the world size."""

    strategy = "distributed"

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        backend: DeviceBackend,
        process_group: Any = None,
        shard_host_weights: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "distributed layerwise offload needs an initialised torch.distributed process group "
                "(backend.init_process_group(rank, world_size, init_method) or torch.distributed.init_process_group)"
            )
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.shard = shard_host_weights and self.world > 1
        self._shards: list[dict[torch.dtype, torch.Tensor]] = []
        self.fingerprints: list[tuple[int, ...]] = []
        self.serial = -1
        self._aborted: set[int] = set()  # blocks whose next load carries an aborted header
        super().__init__(model, blocks, backend, prefetch_depth=1)

    def _plan(self, blocks: list[nn.Module]) -> None:
        super()._plan(blocks)
        self.slot_shape = {dtype: _padded(n, self.world) for dtype, n in self.slot_shape.items()}

    def repack(self, apply=None) -> None:
        raise DistributedOffloadError(
            f"the structure of {self.describe()} changed while it is offloaded across ranks (a dtype change, "
            "a new module or a replaced tensor): call the collective handle.disable() on every rank first"
        )

    @property
    def host_bytes(self) -> int:
        if not self.shard:
            return super().host_bytes
        return self.resident.nbytes + sum(self._shard_bytes(unit) for unit in self.units)

    def host_units(self) -> list:
        if not self.shard:
            return super().host_units()
        return [HostUnit(self.resident, ONCE, self.resident.nbytes),
                *(HostUnit(u, STREAM, self._shard_bytes(u), self._shard_buffers(u)) for u in self.units)]

    def _shard_buffers(self, unit) -> tuple[int, ...]:
        return tuple(_padded(n, self.world) // self.world * dtype.itemsize for dtype, n in unit.numel.items())

    def _shard_bytes(self, unit) -> int:
        return sum(self._shard_buffers(unit))

    @property
    def device_weight_bytes(self) -> int:
        staging = 2 * nbytes_of({d: n // self.world for d, n in self.slot_shape.items()}) if self.shard else 0
        headers = (2 * (len(self.units) + 1) + self._header_rows * self.world) * HEADER * 8 if self.shard else 0
        return super().device_weight_bytes + staging + headers

    @property
    def _header_rows(self) -> int:
        return 2 * (len(self.units) + 1)

    def layout(self) -> tuple:
        """What every rank must have packed alike (see :class:`Agreement`)."""
        units = [self.resident, *self.units]
        sizes = tuple(tuple(sorted((str(d), n) for d, n in u.numel.items())) for u in units)
        return (self.strategy, self.shard, self.world, tuple(self.block_names), sizes, tuple(self.fingerprints))

    def truth(self) -> list:
        if self.shard:  # a rank has only shards of the blocks
            raise DistributedOffloadError(
                "this rank holds only a shard of each block: copying or pickling the model needs the "
                "collective handle.disable() first, which rebuilds the full weights on every rank"
            )
        return super().truth()

    def _new_copy_stream(self):
        stream = _COLLECTIVE_STREAMS.get(self.backend)
        if stream is None:
            stream = _COLLECTIVE_STREAMS[self.backend] = self.backend.new_stream()
        return stream

    def _allocate_device(self) -> None:
        super()._allocate_device()
        if self.shard:
            self._staging = [
                allocate_device(
                    self.backend, {d: n // self.world for d, n in self.slot_shape.items()},
                    f"all-gather staging buffer {s} of {self._name}",
                )
                for s in range(self.num_slots)
            ]
            self._header_out = self.backend.empty_device((self._header_rows, self.world * HEADER), torch.int64)
            self._header_in = self.backend.empty_device((len(self.units) + 1, 2, HEADER), torch.int64)
            label(self._header_out, f"gathered load headers of {self._name}")
            label(self._header_in, f"load headers of {self._name}")
            self._pending: list[tuple[int, int]] = []  # (header row, block) of loads not yet checked
            self._loaded_in_pass = -1  # the furthest block loaded in this pass (a failed rank drains on)

    def _pack(self, txn: Transaction) -> None:
        """Keep only this rank's shard of each block, building one block's padded copy at a time;
        outside their forward the blocks show placeholders. The undo log keeps the original
        tensors until enable succeeds, so a failure can put them back untouched."""
        if not self.shard:
            return super()._pack(txn)
        pack_units([self.resident], self.placement, txn, "resident weights")
        for unit in tqdm(self.units, desc=f"sharding blocks (rank {self.rank} of {self.world})", disable=None, leave=False):
            txn.on_rollback(functools.partial(_rebind_all, unit.originals()))
            self._shards.append(self._shard(unit))
            unit.keep_on(self.backend.device())
            unit.host_views = placeholders(unit)
            unit.bind(unit.host_views)

    def _shard(self, unit) -> dict[torch.dtype, torch.Tensor]:
        """This rank's shard of ``unit``, per dtype, and its fingerprint; the padded copy they are
        cut from dies on return."""
        full = unit.take(lambda n, dtype: torch.zeros(_padded(n, self.world), dtype=dtype))
        self.fingerprints.append(fingerprint(full))
        allocate = self.placement.allocator(unit)
        shards = {}
        for dtype, buffer in full.items():
            size = buffer.numel() // self.world
            shards[dtype] = allocate(size, dtype)
            shards[dtype].copy_(buffer[self.rank * size : (self.rank + 1) * size])
        return shards

    def _show_placeholders(self) -> None:
        if not self.shard:  # sharded blocks were given theirs while packing
            super()._show_placeholders()

    def _instrument(self) -> None:
        super()._instrument()
        if self.shard:
            # a rank cannot produce or take a full state dict: refuse it at every module it would reach
            refuse = functools.partial(_refuse_state_dict, self.describe())
            modules = {id(m): m for b in self.blocks for m in b.modules()}
            modules[id(self.model)] = self.model
            for module in modules.values():
                self._hooks.append(module.register_state_dict_pre_hook(refuse))
                self._hooks.append(module.register_load_state_dict_pre_hook(refuse))

    def _write_headers(self) -> None:
        if not self.shard:
            return
        rows = torch.tensor(  # one row per block, then the end of a pass (index -1)
            [[[MAGIC, self.serial, i, status] for status in (OK, ABORTED)] for i in [*range(len(self.units)), END]],
            dtype=torch.int64,
        )
        self.backend.copy_async(self._header_in, rows, self.copy_stream)  # the gathers follow on this stream
        self.copy_stream.synchronize()  # landed before an enable that rolls back drops the buffer

    def _plan_transfers(self) -> None:
        if not self.shard:
            return super()._plan_transfers()
        self._write_headers()
        self._transfers = []
        for i, (unit, shards) in enumerate(zip(self.units, self._shards)):
            slot, staging = self.slots[i % self.num_slots], self._staging[i % self.num_slots]
            direct = self.placement.tier(unit) in (Tier.PINNED, Tier.PAGEABLE)
            self._transfers.append([
                (staging[dtype][: shard.numel()], shard if direct else functools.partial(_read_flat, shard),
                 slot[dtype][: shard.numel() * self.world])
                for dtype, shard in shards.items()
            ])
        self._transfer_copies = [
            self.placement.copies([(staging, src) for staging, src, _ in transfers]) for transfers in self._transfers
        ]
        self._images = [None] * len(self.units)  # shards are never on disk
        self._transfer_bytes = [sum(s.numel() * s.element_size() for s in shards.values()) for shards in self._shards]

    def _issue(self, i: int, stream) -> None:
        if not self.shard:
            return super()._issue(i, stream)
        self._gather_header(i, self._header_status(i))
        self._loaded_in_pass = max(self._loaded_in_pass, i)
        for staging, shard, out in self._transfers[i]:
            self.placement.issue([(staging, shard)], stream)
            self.backend.all_gather_into_tensor(out, staging, self.group, stream).wait(stream)

    def _gather_header(self, i: int, status: int) -> None:
        """Queue the all-gather of block ``i``'s header (``END``: the end of a pass)."""
        if len(self._pending) == self._header_rows:
            self._check_headers()
        row, stream = len(self._pending), self.copy_stream
        header, out = self._header_in[i, status], self._header_out[row]
        gathered = self.backend.all_gather_into_tensor(out, header, self.group, stream)
        gathered.wait(stream)
        self._pending.append((row, i))

    def _finish(self, failed: bool) -> None:
        """End of a pass (or of a block called alone): say whether this rank got through, and
        check every header since the last check."""
        self._drain_loads()
        self._gather_header(END, ABORTED if failed else OK)
        if failed:
            try:
                self._check_headers()
            except DistributedOffloadError as exc:
                logger.warning("after this rank's failure: %s", exc)
        else:
            self._check_headers()

    def _check_headers(self) -> None:
        """Wait for the queued gathers and compare every rank's header of each: a gather that
        paired different blocks, or a rank that aborted its pass, is an error here."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        seen = torch.empty((len(pending), self.world * HEADER), dtype=torch.int64)
        self.backend.copy_async(seen, self._header_out[: len(pending)], self.copy_stream)  # after the gathers
        self.copy_stream.synchronize()
        self._queued = False  # every load queued so far has landed
        headers = seen.view(len(pending), self.world, HEADER).tolist()
        for (_, block), row in zip(pending, headers):
            for rank, header in enumerate(row):
                if header[:3] != [MAGIC, self.serial, block]:
                    raise DistributedOffloadError(
                        f"ranks out of step in {self.describe()}: this rank (rank {self.rank}) was at "
                        f"{self._label(block)} while rank {rank} was at {self._label_of(header)} in the same gather; "
                        "the output of this call is discarded (gathers that pair different blocks would mix their "
                        "weights). Every rank must run the same forwards in the same order"
                    )
        for row in headers:
            for rank, header in enumerate(row):
                if header[3] == ABORTED:
                    raise DistributedOffloadError(
                        f"rank {rank} failed during this forward of {self.describe()}; its output is discarded on "
                        "every rank. The ranks are still in step: the next forward can run"
                    )

    def _label(self, block: int) -> str:
        return "the end of a forward" if block == END else f"block {self.block_names[block]}"

    def _label_of(self, header: list[int]) -> str:
        magic, serial, block, _ = header
        if magic != MAGIC or serial != self.serial or not END <= block < len(self.units):
            return "another model's gather or unrelated data"
        return self._label(block)

    def _write_back_block(self, i: int):
        if not self.shard:
            return super()._write_back_block(i)
        return functools.partial(self._write_back_shard, i)

    def _write_back_shard(self, i: int, pairs) -> None:
        """A forward changed block ``i``'s tensors (a buffer updated in place; the slot holds the
        new values): copy this rank's slice of the slot into its shard. Every rank runs the same
        forward, so every rank updates its own slice alike. The headers are checked first, so that
        values computed on mismatched weights are never kept."""
        self._drain_loads()  # the stager appends the headers of the loads it issues
        self._check_headers()
        slot = self.slots[i % self.num_slots]
        stream = self.backend.current_stream()
        for dtype, shard in self._shards[i].items():
            size = shard.numel()
            self.backend.copy_async(shard, slot[dtype][self.rank * size : (self.rank + 1) * size], stream)
        done = self.backend.new_event()
        done.record(stream)
        done.synchronize()

    def _reconcile(self, blocks) -> None:
        if not self.shard:
            return super()._reconcile(blocks)
        changed = [
            f"{self.block_names[i]}:{owner.name}"
            for i in blocks
            for _, owner in self.units[i].foreign(self.units[i].host_views)
        ]
        changed += [f"{self.block_names[i]} (changed in place)" for i in blocks if self._bindings[i].touched()]
        if changed or self.dirty:
            raise DistributedOffloadError(
                f"tensors of {self.describe()} were replaced while its blocks are sharded across ranks "
                f"({', '.join(changed[:4]) or 'a module or tensor was added'}); a rank holds only a shard of "
                "each block, so changes need the collective handle.disable() first"
            )

    def _release(self) -> None:
        super()._release()
        self._staging = []
        self._header_in = self._header_out = None

    def _end_pass(self, failed: bool) -> None:
        if not self.shard or self._passes > 1:
            return super()._end_pass(failed)
        try:
            if failed:
                self._drain_loads()  # the stager's loads have set how far this pass got
                # the others will still load the blocks after the furthest one loaded here
                for i in range(self._loaded_in_pass + 1, len(self.units)):
                    self._load_aborted(i)
            self._finish(failed)
        finally:
            self._loaded_in_pass = -1  # loads queued from here on belong to the next pass
            super()._end_pass(failed)

    def _after_block(self, i: int, failed: bool) -> None:
        alone = self.shard and self._passes == 0 and self._bound == i
        try:
            super()._after_block(i, failed)
        finally:
            if alone:
                self._finish(failed)

    def end_backward(self) -> None:
        """A backward's loads gathered headers too: its end is checked like a pass's (every rank
        runs the same backward), before its gradients are used."""
        if self.shard:
            try:
                self._finish(False)
            finally:
                self._loaded_in_pass = -1
        super().end_backward()

    def _untrainable(self, i: int) -> Exception:
        if not self.shard:
            return super()._untrainable(i)
        return DistributedOffloadError(
            f"weights of block {self.block_names[i]} of {self.describe()} require grad, but each rank holds only "
            "a shard of them: freeze them (requires_grad_(False)), or enable with shard_host_weights=False to train them"
        )

    def _load_aborted(self, i: int) -> None:
        """The load the other ranks run for block ``i``, flagged as aborted by this rank, so that
        they are not left waiting for a partner that never comes."""
        self._aborted.add(i)
        try:
            self._load(i)
        except BaseException:
            self._aborted.discard(i)
            raise

    def _header_status(self, i: int) -> int:
        """Block ``i``'s header status, read where its load is issued (on the stager thread for
        staged shards, after ``_load_aborted`` has returned) and consumed there."""
        if i in self._aborted:
            self._aborted.discard(i)
            return ABORTED
        return OK

    def _drain_loads(self) -> None:
        """Wait until the stager has issued every load handed to it: their gathers come before
        any this thread issues next, on every rank alike."""
        self.placement.drain()

    def disable(self) -> None:
        """Collective when sharded: rebuild every block's full weights from the shards on every
        rank, check that every rank gathered the same blocks, then give the weights back. If the
        ranks are out of step, raises and leaves the model offloaded (call again once in step)."""
        with self.lock:
            if not self.shard or not self.enabled:
                return super().disable()
            rebuilt = self._gather_all()
            self._remove_hooks()
            for i, unit in enumerate(self.units):
                unit.host = rebuilt[i]  # unpacked from here; owners still show their placeholders
            self._shards = []
            super().disable()

    def _gather_all(self) -> list[dict[torch.dtype, torch.Tensor]]:
        host = self.backend.new_stream()
        rebuilt = []
        try:
            self._quiesce()
            self._check_headers()
            for i, unit in enumerate(self.units):
                self._load(i)
                self.wait_ready(i, host)
                slot = self.slots[i % self.num_slots]
                buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in unit.numel.items()}
                for dtype, buf in buffers.items():
                    self.backend.copy_async(buf, slot[dtype][: buf.numel()], host)
                host.synchronize()  # later copies into this slot are queued after this: ordered
                rebuilt.append(buffers)
            self._check_headers()
        except Exception as exc:  # a mismatch, or the collective failed or timed out
            self._queued, self._pending = False, []
            raise DistributedOffloadError(
                f"handle.disable() cannot restore the exact weights of {self.describe()}: rank {self.rank} holds "
                f"only a shard of each block and rebuilding them with the other ranks failed ({exc}). Nothing was "
                "changed: the model is still offloaded; call disable() again on every rank once they are in step"
            ) from exc
        finally:
            self._quiesce()
        return rebuilt


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


def _refuse_state_dict(name: str, module: nn.Module, *args: Any) -> None:
    raise DistributedOffloadError(
        f"this rank holds only a shard of each block of {name}: a state dict (saving or loading) needs the "
        "collective handle.disable() first, which rebuilds the full weights on every rank"
    )


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
        parts = [p for p in self.parts if isinstance(p, DistributedLayerwiseOffload)]
        if exc_type is None:
            for k, part in enumerate(parts):
                part.serial = _serials["next"] + k
        mine = {
            "rank": dist.get_rank(self.group),
            "ok": exc_type is None,
            "error": f"{exc_type.__name__}: {exc}" if exc_type is not None else "",
            "layout": [p.layout() for p in parts] if exc_type is None else None,
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
        for part in parts:
            part._write_headers()
        _serials["next"] += len(parts)
        return False
