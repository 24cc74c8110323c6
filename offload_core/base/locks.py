"""Work under a lock that no interrupt can leave held.

A ``KeyboardInterrupt`` can be raised between two lines of the library by Ctrl-C's signal
handler, which CPython runs at function starts, after calls and on backward jumps, and by a trace
function (a debugger, a test injecting interrupts line by line), which can raise at every line
event. A ``with lock:`` block is safe from the first: nothing that can raise runs between
``__enter__`` and the block, nor between the block's end and ``__exit__``. It is not safe from
the second: the ``with`` line gets a line event again when its block ends, *before* ``__exit__``
releases the lock, and an exception raised there skips the release. The next ``acquire`` then
waits forever (issue 42: a model-level load hung in ``labels.label`` after an interrupt).

:func:`locked` is the one form the library takes its locks in: the ``with`` statement and the
call of the work on one line, so that no line event comes between the work's end and the release.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = ["locked"]

T = TypeVar("T")


def locked(lock: Any, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` with ``lock`` held; released whatever interrupts it."""
    with lock: return work(*args)  # noqa: E701 - one line on purpose: see the module docstring
