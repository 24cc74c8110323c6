"""Small real checkpoints to damage, and a witness of every file a load opens.

A tiny Wan DiT saved by diffusers' ``save_pretrained`` (one file, or shards with their index),
the header of a safetensors file read and written back byte for byte, and :class:`Reads`, which
records each file opened while it is on: through Python (``open``, ``os.open``: the audit hook
sees every one, in any thread) and through anything else (the safetensors library's Rust code
reading for diffusers) on the files it watches with inotify.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import sys
import threading

import torch

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def tiny_wan(seed: int = 0):
    """A two-block Wan DiT with seeded weights, in eval mode, and inputs for it."""
    from diffusers import WanTransformer3DModel
    from denoisers import build_transformer

    small, inputs = build_transformer("wan-t2v")
    torch.manual_seed(seed)
    return WanTransformer3DModel.from_config({**small.config, "num_layers": 2}).eval(), inputs


def save(model, folder, sharded: bool = False) -> None:
    """``model`` saved as diffusers saves it: one file, or (``sharded``) several shards and the index."""
    model.save_pretrained(folder, max_shard_size="16KB" if sharded else "10GB")
    assert os.path.isfile(os.path.join(folder, INDEX)) == sharded


def read_header(path) -> tuple[dict, bytes]:
    """The parsed header of a safetensors file and the data section after it."""
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write(path, header: bytes | dict, data: bytes, length: int | None = None) -> None:
    """A safetensors file of ``header`` (JSON text, or an object to encode) and ``data``, its
    length field ``length`` if given, else the header's true length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)


def copy_folder(source, target) -> None:
    shutil.copytree(source, target, symlinks=True)


class Reads:
    """Every path opened while recording (resolved), and the watched files anything opened."""

    _hooked = False
    _active: "Reads | None" = None

    def __init__(self, watched=()) -> None:
        if not Reads._hooked:  # an audit hook cannot be removed: one for the process, idle unless recording
            sys.addaudithook(Reads._audit)
            Reads._hooked = True
        self.opened: list[str] = []
        self._lock = threading.Lock()
        self._inotify = _Inotify(watched)

    @staticmethod
    def _audit(event: str, args: tuple) -> None:
        active = Reads._active
        if active is not None and event == "open" and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            with active._lock:
                active.opened.append(path)

    def __enter__(self) -> "Reads":
        self.opened = []
        self._inotify.drain()
        Reads._active = self
        return self

    def __exit__(self, *exc) -> None:
        Reads._active = None

    def touched(self) -> list[str]:
        """The watched files something opened or read since recording began."""
        return self._inotify.drain()

    def close(self) -> None:
        self._inotify.close()


class _Inotify:
    """Open and read events on a few files, from any reader in any language (Linux only)."""

    _IN_ACCESS, _IN_OPEN = 0x1, 0x20

    def __init__(self, paths) -> None:
        self.fd = -1
        self.names: dict[int, str] = {}
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        if libc is None or not hasattr(libc, "inotify_init1"):
            return
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        for path in paths:
            wd = libc.inotify_add_watch(self.fd, os.fsencode(path), self._IN_ACCESS | self._IN_OPEN)
            assert wd >= 0, f"cannot watch {path}: errno {ctypes.get_errno()}"
            self.names[wd] = os.fspath(path)

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def drain(self) -> list[str]:
        touched = []
        while self.fd >= 0:
            try:
                raw = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            at = 0
            while at < len(raw):
                wd, _, _, size = struct.unpack_from("iIII", raw, at)
                touched.append(self.names.get(wd, "?"))
                at += 16 + size
        return touched

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
