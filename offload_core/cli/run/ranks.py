"""``offload-core run --strategy distributed``: one process per rank, started by torchrun.

Every rank builds the same pipeline, enables distributed layerwise offload over the default
process group (joined through the backend's collective library: gloo for the fake, NCCL or HCCL
on devices, from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``) and makes
the same seeded call. Afterwards every rank's output is gathered and checked equal on every rank
(a rank that computed on other weights fails the run on all of them), and only rank 0 prints the
report and writes the files.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from ..common import UsageError

#: what torchrun sets in every process it starts
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = "torchrun --nproc-per-node N -m offload_core run --strategy distributed ..."


def check_launched() -> None:
    """Bad input, before any work: distributed without a launcher's environment."""
    missing = [v for v in LAUNCHER_VARIABLES if v not in os.environ]
    if missing:
        raise UsageError(
            f"--strategy distributed runs one process per rank, started by a launcher ({', '.join(missing)} not "
            f"set): {LAUNCH_HINT}"
        )


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def process_group(backend: Any) -> Iterator[None]:
    """The default process group for the run, from the launcher's environment; left as found."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    backend.init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_outputs_equal(output: torch.Tensor) -> int:
    """Gather every rank's output and check each equals this rank's; returns the world size.
    Raises on every rank when one differs."""
    import torch.distributed as dist

    outputs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outputs, output.cpu())
    differing = [r for r, other in enumerate(outputs) if not torch.equal(other, outputs[0])]
    if differing:
        raise RuntimeError(f"the ranks' outputs differ: rank(s) {differing} differ from rank 0")
    return len(outputs)
