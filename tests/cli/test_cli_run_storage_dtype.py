"""``offload-core run --storage-dtype``: the DiT stored and streamed narrow (``storage_dtype=``),
its copies and homes counted as stored, the output that of the same casting without offload
(``--compare``); without offload the flag is bad input."""

from __future__ import annotations

import json

import pytest

from offload_core import cli
from offload_core.device.plugins import ENV_BACKEND

pytestmark = pytest.mark.fake_only("the copies counted are the fake's")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["run", "--pipeline", "flux2-deep", "--steps", "2", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_dit_streams_in_float8_and_equals_the_same_casting_without_offload(capsys, monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    reports = {}
    for flag in ((), ("--storage-dtype", "float8_e4m3fn", "--compare")):
        code, out, err = run(capsys, "--backend", "fake", "--json", *flag)
        assert code == 0, err
        reports[bool(flag)] = json.loads(out)
    wide, narrow = reports[False], reports[True]
    # the demo is float32: its blocks' Linear weights are a quarter as wide, its norms unchanged
    assert narrow["call_h2d_bytes"] < 0.3 * wide["call_h2d_bytes"]
    assert narrow["host_bytes"] < 0.3 * wide["host_bytes"]
    assert narrow["compare"]["same_output"] is True


def test_storage_dtype_needs_offload(capsys):
    code, _, err = run(capsys, "--strategy", "none", "--storage-dtype", "float8_e4m3fn")
    assert code == 2 and "--storage-dtype does not apply to --strategy none" in err


def test_an_unknown_storage_dtype_is_bad_input(capsys):
    code, _, err = run(capsys, "--storage-dtype", "int8")
    assert code == 2 and "invalid choice: 'int8'" in err
