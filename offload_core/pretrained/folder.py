"""The files of a local model folder that ``offload_core.from_pretrained`` reads, each confined to
the folder.

A downloaded folder is not to be trusted with paths: a shard index may name ``../x``, an absolute
path or a symbolic link out of the folder, and a pipeline's ``model_index.json`` names its
component subfolders. Every path read from the folder (a shard, an index, a config, a component
subfolder) is refused with a :class:`~offload_core.base.errors.CheckpointError` when it is absolute,
has a ``..`` component, or resolves (symbolic links followed, the folder's own path resolved too)
outside the folder. One place is allowed besides: the ``blobs`` folder of a Hugging Face hub cache
entry, when the folder is one of its ``snapshots`` (every file there is a link into ``blobs``).
"""

from __future__ import annotations

import json
import os
import re

from ..base.errors import CheckpointError


class ModelFolder:
    """A model folder and the places its files may resolve to."""

    def __init__(self, path: str | os.PathLike, roots: tuple[str, ...] | None = None) -> None:
        self.path = os.fspath(path)
        self.real = os.path.realpath(self.path)
        self._roots = (self.real, *_hub_blobs(self.real)) if roots is None else (self.real, *roots[1:])

    def file(self, relative: object, named_by: str) -> str:
        """The resolved path of ``relative`` (a path ``named_by`` names) inside the folder."""
        if not isinstance(relative, str) or not relative or "\0" in relative or not _encodable(relative):
            raise CheckpointError(f"{named_by} names {relative!r}, which is not a file name")
        if os.path.isabs(relative) or re.match(r"^[A-Za-z]:|^[\\/]", relative):
            raise CheckpointError(f"{named_by} names {relative!r}, an absolute path: files of {self.path} are "
                                  "named relative to it")
        if ".." in re.split(r"[\\/]", relative):
            raise CheckpointError(f"{named_by} names {relative!r}, which leaves {self.path} through '..'")
        real = os.path.realpath(os.path.join(self.real, relative))
        if not any(_inside(real, root) for root in self._roots):
            raise CheckpointError(f"{named_by} names {relative!r}, which resolves to {real}, outside {self.path} "
                                  "(a symbolic link out of the model folder)")
        return real

    def subfolder(self, name: object, named_by: str) -> "ModelFolder":
        """A folder inside this one (a pipeline's component), confined in turn to itself."""
        return ModelFolder(self.file(name, named_by), self._roots)

    def has(self, relative: str) -> bool:
        return os.path.isfile(os.path.join(self.real, relative))

    def read_json(self, relative: str) -> dict:
        """The JSON object in file ``relative`` of the folder."""
        path = self.file(relative, self.path)
        try:
            with open(path, encoding="utf-8") as f:
                found = json.load(f, parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
        if not isinstance(found, dict):
            raise CheckpointError(f"{path} holds a JSON {type(found).__name__}, not an object")
        return found

    def weight_files(self, index_name: str, single_name: str) -> tuple[list[str], bool] | None:
        """The safetensors files of the folder, and whether they are shards: those the shard
        index ``index_name`` maps tensors to (plain file names, as diffusers requires), else the
        single file ``single_name``, else None."""
        if self.has(index_name):
            index = self.read_json(index_name)
            where = os.path.join(self.path, index_name)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{where}: weight_map must be an object of tensor names to shard file names")
            paths = [name for name in weight_map.values() if os.path.basename(name) != name]
            if paths:  # as diffusers requires
                raise CheckpointError(f"{where} names shard {paths[0]!r}: a shard is a file name of the folder, "
                                      "not a path")
            files = sorted({self.file(name, where) for name in weight_map.values()})  # resolved: a link read once
            absent = [path for path in files if not os.path.isfile(path)]
            if absent:
                raise CheckpointError(f"{where} maps tensors to {absent[0]}, which is not a file of {self.path}")
            return files, True
        if self.has(single_name):
            return [self.file(single_name, self.path)], False
        return None


def _encodable(name: str) -> bool:
    try:
        os.fsencode(name)
    except UnicodeEncodeError:  # half a surrogate pair, spelled by a JSON escape
        return False
    return True


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blobs(real: str) -> tuple[str, ...]:
    """``<entry>/blobs`` when ``real`` is ``<entry>/snapshots/<revision>`` of a hub cache."""
    snapshots = os.path.dirname(real)
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return (blobs,) if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs) else ()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
