"""Issue 42, item 2 (docs/cli.md): Ctrl-C in any command ends it with ``offload-core: interrupted``
on stderr and exit status 130, never a traceback.

Each command runs in a process of its own and gets a real SIGINT while it works. Where it says so
itself, the signal comes when it does: ``run -v`` logs the pipeline call it starts, and
``check-backend`` prints the kit's command line and then the kit's output. The others print
nothing until they are done; they run through :data:`DRIVER`, which wraps a function their work
calls so that reaching it is said on stderr, the work then going on as usual (and the command
waiting before it finishes, so that a fast machine cannot finish it before the signal comes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from offload_core.cli import build_parser

#: runs the command in argv[2:] with the function argv[1] ("module:name") wrapped (see the docstring)
DRIVER = """
import functools, importlib, sys, time
module, name = sys.argv[1].split(":")
owner = importlib.import_module(module)
real = getattr(owner, name)

@functools.wraps(real)
def working(*args, **kwargs):
    print("test: the command is working", file=sys.stderr, flush=True)
    result = real(*args, **kwargs)
    time.sleep(600)
    return result

setattr(owner, name, working)
from offload_core.cli import main
raise SystemExit(main(sys.argv[2:]))
"""
WORKING = "test: the command is working"


def driven(out: list[str], err: list[str]) -> bool:
    return any(WORKING in line for line in err)


def calling(out: list[str], err: list[str]) -> bool:
    return any("calling" in line for line in err)  # run -v: the pipeline call has begun


def kit_output(out: list[str], err: list[str]) -> bool:
    """check-backend printed the kit's command line, then the kit printed a line."""
    start = next((k for k, line in enumerate(out) if line.startswith("$ ")), None)
    return start is not None and any(line.strip() for line in out[start + 1:])


#: subcommand -> (the function its work calls that DRIVER wraps, or None; its arguments; the sign it works)
CASES = {
    "backends": ("offload_core.device.plugins:list_backends", ["backends"], driven),
    "plan": ("offload_core.planning:make_plan", ["plan", "--device-memory", "1GiB"], driven),
    "bench": ("offload_core.bench.layerwise:tiny_wan", ["bench", "--only", "layerwise_overhead", "--quick"], driven),
    "run": (None, ["run", "-v", "--steps", "1000"], calling),
    "check-backend": (None, ["check-backend", "fake"], kit_output),
}
STARTUP_S = 600  # the shared CI machine can take minutes to import torch and diffusers
EXIT_S = 120


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def test_every_command_is_checked():
    assert set(CASES) == subcommands()


class Child:
    """A command in a process of its own, its two streams read as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # a shell that starts a job in the background ignores SIGINT for it: undo that, or
            # Python would keep ignoring it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self.changed:
                lines.append(line)
                self.changed.notify_all()
        with self.changed:
            lines.append("")  # end of the stream
            self.changed.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate() or self.process.poll() is not None, timeout)

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        for reader in self.readers:
            reader.join(timeout)
        return code


@pytest.mark.parametrize("name", CASES)
def test_ctrl_c_while_a_command_works_is_one_line_and_exit_130(name):
    wrapped, argv, works = CASES[name]
    command = [sys.executable, "-c", DRIVER, wrapped, *argv] if wrapped else [sys.executable, "-m", "offload_core", *argv]
    child = Child(command)
    try:
        assert child.wait_for(lambda: works(child.out, child.err), STARTUP_S), "the command never began its work"
        assert child.process.poll() is None, f"the command ended before the signal:\n{''.join(child.err)}"
        helpers = child_processes(child.process.pid)
        child.process.send_signal(signal.SIGINT)
        code = child.finish(EXIT_S)
    finally:
        if child.process.poll() is None:
            child.process.kill()
    stderr = "".join(child.err)
    assert code == 130, stderr
    assert "offload-core: interrupted" in stderr.splitlines(), stderr
    assert "Traceback" not in stderr, stderr
    still = [p for p in helpers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not still, f"{name} left {still} running"  # check-backend's kit stops with it


def child_processes(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)
