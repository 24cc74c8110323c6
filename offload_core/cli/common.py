"""What every subcommand module shares: the one error type, the backend check, table layout, and
output files (checked before any work, written all or none)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from ..device import plugins

#: (final path, function writing the file to the path it is given)
Writer = tuple[Path, Callable[[Path], None]]


class UsageError(Exception):
    """Bad input: reported as ``offload-core: error: <message>`` with exit status 2."""


def available_backend(name: str | None) -> plugins.BackendInfo:
    """The backend ``name`` (None: the one selection picks), or a UsageError saying why it cannot
    be used here; checked before any model is built or process started."""
    from ..device import plugins

    registry = plugins.registry()
    try:
        info = registry.info(name) if name is not None else registry.resolve(None)[0]
    except plugins.BackendNotFoundError as exc:
        raise UsageError(str(exc)) from None
    reason = info.unavailable_reason()
    if not info.available:
        raise UsageError(f"backend {info.name!r} is registered but not available here" + (f": {reason}" if reason else ""))
    return info


def budget_type(of: str | None) -> Callable[[str], str]:
    """The argparse type of a size flag: the text, once the options' own parser accepts it (so a
    typo fails before anything loads, and the text means what the same string means in the API).
    A fraction is of ``of`` ("RAM", "the device's memory"); with ``of`` None the flag takes a size
    only."""

    def parse(text: str) -> str:
        import argparse

        from ..common.config import parse_budget

        try:
            parse_budget(text, of=of)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` (the header first, if any) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def check_writable(flag: str, value: str) -> None:
    """``value`` can be created or replaced as a file: its directory exists and takes a new file
    (tried, not inferred from permission bits, which a superuser or a read-only mount make lie)."""
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {value!r} is a directory; name a file")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {value!r}: the directory {str(folder)!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".offload-core-", suffix=".tmp"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {value!r}: cannot write in {str(folder)!r} ({exc.strerror or exc})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {value!r}: the file exists and is not writable")


def write_all(writers: Sequence[Writer]) -> list[Path]:
    """Write every file, all of them or none: each writer writes a temporary file beside its
    target; once all have been written they are renamed into place, a file they replace first
    moved aside. On any failure (a full disk, an image that cannot be encoded, a rename refused)
    the renamed files are taken back, the replaced ones restored, the temporary ones removed, and
    the error re-raised. A target that is a directory (a video frame's name taken by one: the
    frame count is known only now) is a UsageError before anything is written: a directory is
    never moved aside. Returns the final paths."""
    finals = [final for final, _ in writers]
    if len({f.resolve() for f in finals}) < len(finals):
        raise ValueError(f"two outputs name the same file: {', '.join(map(str, finals))}")
    for final in finals:
        if final.is_dir():
            raise UsageError(f"{str(final)!r} is a directory, so it cannot take an output file; no file was written")
    # names of this process only (the targets are distinct), created with the usual mode
    staged = [(final.with_name(f".{final.name}.{os.getpid()}.tmp"), final) for final in finals]
    done: list[tuple[Path, Path | None]] = []  # (final, where the file it replaced was moved)
    try:
        for (temporary, _), (_, write) in zip(staged, writers):
            write(temporary)
        for temporary, final in staged:
            aside = None
            if final.exists():
                aside = final.with_name(f".{final.name}.{os.getpid()}.old")
                os.replace(final, aside)
            done.append((final, aside))
            os.replace(temporary, final)
    except BaseException:
        for final, aside in reversed(done):
            with contextlib.suppress(OSError):
                if aside is not None:
                    os.replace(aside, final)
                else:
                    final.unlink()
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        raise
    for _, aside in done:
        if aside is not None:
            with contextlib.suppress(OSError):
                aside.unlink()
    return finals
