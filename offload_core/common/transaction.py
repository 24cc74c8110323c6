"""The undo log of ``enable`` (and of a re-pack): every step registers how to undo itself before
it runs, so a failure anywhere leaves the model exactly as it was."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


class Transaction:
    """Undo log for ``enable``: on failure, the steps done so far are undone in reverse, so the
    model is left exactly as it was (same tensors' values, dtypes, strides; no hooks).

    Inside it ``torch.inference_mode`` is off: an enable or re-pack that happens to run under it
    (the user's ``with torch.inference_mode():`` around ``enable_offload`` or around the forward
    that re-packs) must still build ordinary tensors, or every later in-place copy into a slot or
    home outside inference mode would fail."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._mode = torch.inference_mode(False)

    def on_rollback(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def __enter__(self) -> "Transaction":
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._rollback(exc_type)
        finally:
            self._mode.__exit__(exc_type, exc, tb)
        return False

    def _rollback(self, exc_type) -> None:
        if exc_type is not None:
            for fn in reversed(self._undo):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - keep undoing; the original error is what matters
                    logger.exception("rollback step failed while undoing a failed enable")
        self._undo.clear()
