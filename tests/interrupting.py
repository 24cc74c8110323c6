"""Interrupts injected line by line: a trace function that lists the points a piece of work
reaches in the library, or raises a ``KeyboardInterrupt`` (as Ctrl-C does) at one of them."""

from __future__ import annotations

from pathlib import Path

import offload_core

LIBRARY = str(Path(offload_core.__file__).parent)

Point = tuple[str, int, int]  # (file, line, instruction offset)


class Injected(KeyboardInterrupt):
    """The interrupt the trace raises."""


class Tracer:
    """Lists the points reached in files under ``roots`` (``stop_at`` None), or raises
    :class:`Injected` at the first time point ``stop_at`` is reached."""

    def __init__(self, stop_at: Point | None = None, roots: tuple[str, ...] = (LIBRARY,)) -> None:
        self.stop_at = stop_at
        self.roots = roots
        self.reached: dict[Point, None] = {}
        self.fired = False

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(self.roots) else None

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            where = (frame.f_code.co_filename, frame.f_lineno, frame.f_lasti)
            if self.stop_at is None:
                self.reached.setdefault(where)
            elif where == self.stop_at:
                self.fired = True
                raise Injected(f"{where[0]}:{where[1]}")
        return self._line
