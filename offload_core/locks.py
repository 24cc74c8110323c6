"""Work under a lock that no interrupt can leave held.

A ``KeyboardInterrupt`` may be raised between any two lines of the library: by Ctrl-C's signal
handler, which CPython runs after calls and on backward jumps, and by a trace function (a
debugger, a test that injects interrupts line by line), which runs at every line event. A
``with lock:`` block is safe from the first: nothing that can raise runs between ``__enter__``
and the block, nor between the block's end and ``__exit__``. It is not safe from the second: the
``with`` line is reached again when its block ends, *before* ``__exit__`` releases the lock, and
an exception raised there skips the release. The next ``acquire`` of that lock then waits
forever (issue 42: a model-level load hung in ``labels.label`` after an interrupt).

:func:`locked` is the one form the library uses instead: the whole ``with`` statement on one
line, so that the block's end and the release are on the same line and no line event separates
them. The locked work is a function of its own, whose lines are all inside the block.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = ["locked"]

T = TypeVar("T")


def locked(lock: Any, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` with ``lock`` held; the lock is released whatever interrupts it."""
    with lock: return work(*args)  # noqa: E701 - one line on purpose: see the module docstring
