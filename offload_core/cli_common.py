"""What every subcommand module shares: the one error type, the backend check, table layout, and
output files (checked before any work, written all or none)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from . import plugins

#: (final path, function writing the file to the path it is given)
Writer = tuple[Path, Callable[[Path], None]]


class UsageError(Exception):
    """Bad input: reported as ``offload-core: error: <message>`` with exit status 2."""


def available_backend(name: str | None) -> plugins.BackendInfo:
    """The backend ``name`` (None: the one selection picks), or a UsageError saying why it cannot
    be used here; checked before any model is built or process started."""
    registry = plugins.registry()
    try:
        info = registry.info(name) if name is not None else registry.resolve(None)[0]
    except plugins.BackendNotFoundError as exc:
        raise UsageError(str(exc)) from None
    reason = info.unavailable_reason()
    if not info.available:
        raise UsageError(f"backend {info.name!r} is registered but not available here" + (f": {reason}" if reason else ""))
    return info


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
    """Run every writer into a temporary file beside its target, then rename them all into place;
    on any failure remove the temporary files and re-raise. Returns the final paths. So a failure
    (a full disk, an image that cannot be encoded) leaves no partial file, and no file of a run
    whose other files could not be written."""
    staged: list[tuple[Path, Path]] = []
    try:
        for final, write in writers:
            # a name of this process only (the targets are distinct), created with the usual mode
            temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
            staged.append((temporary, final))
            write(temporary)
        for temporary, final in staged:
            os.replace(temporary, final)
    except BaseException:
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        raise
    return [final for _, final in staged]
