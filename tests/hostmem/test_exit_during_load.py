"""A process interrupted while the stager copies a big load exits at once, without aborting.

The stager is a daemon thread: one still inside a torch call when the interpreter finalises is
ended by pthread_exit, whose unwinding through torch's C++ frames aborts the process
("terminate called without an active exception"), a core dump where the user pressed Ctrl-C.
The exit hook stops it first; a load of gigabytes from disk takes longer than that hook waits, so
the load itself must stop at its next chunk.
"""

from __future__ import annotations

import signal
import subprocess
import sys

#: a child that is sent SIGINT (Ctrl-C) half a second into a staged load of 512 chunks, each of
#: which spends ~50 ms in torch code on the stager thread: ~25 s, far beyond the hook's join
SCRIPT = r"""
import atexit, os, signal, threading, time
import torch
import offload_core
from offload_core.hostmem import staging

staging.BOUNCE_CHUNK_BYTES = 4096
interrupted = []
atexit.register(lambda: print(f"hooks took {time.monotonic() - interrupted[0]:.3f}", flush=True))
heavy = torch.ones(8_000_000)
started = threading.Event()
copy = staging.BounceRing._copy

def slow(self, chunk, stream):
    started.set()
    for _ in range(10):
        heavy.mul_(1.0)
    copy(self, chunk, stream)

def interrupt():
    started.wait()
    time.sleep(0.5)
    interrupted.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)

staging.BounceRing._copy = slow
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
offload_core.enable_offload(model, backend="fake", pinned_memory=0, enable_cpu_offload=True)
threading.Thread(target=interrupt, daemon=True).start()
model(torch.ones(1, 256))
"""


def test_ctrl_c_during_a_long_staged_load_exits_promptly_and_cleanly():
    child = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert "terminate called" not in child.stderr
    assert child.returncode == -signal.SIGINT, child.stderr[-2000:]
    assert "KeyboardInterrupt" in child.stderr
    hooks = float(child.stdout.split("hooks took ")[1])
    assert hooks < 2.0  # the stager left within a chunk, not at the end of the join
