"""Spill files never outlive their use: a process ended by SIGTERM or SIGHUP during enable or a
forward leaves its spill folder empty (the handler chains to the program's own, which decides
whether the process ends); the descriptors of spill files close at ``disable()`` and at a failed
enable, not at the next garbage collection; at most a few are open at once whatever the number
of blocks (500 under ``RLIMIT_NOFILE=256``); a disk that fills during spilling gives back what
was written before the error is raised, and a retry with room works."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import offload_core
from offload_core.hostmem import descriptors, spill

from helpers import chaos_backend, descriptors_under, snapshot

pytestmark = pytest.mark.fake_only

#: a stack of blocks, offloaded with every block spilled to the folder named by argv[1]; argv[2]
#: says where the script stops to be signalled; argv[3] what it installs as SIGTERM's handler first
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch import nn
    import offload_core
    from offload_core.hostmem import spill

    folder, stop, previous = sys.argv[1], sys.argv[2], sys.argv[3]
    for signum in (signal.SIGTERM, signal.SIGHUP):  # the defaults, whatever the test runner inherited (nohup)
        signal.signal(signum, signal.SIG_DFL)
    if previous == "exits":
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))
    elif previous == "records":
        signal.signal(signal.SIGTERM, lambda s, f: print("HANDLED", flush=True))
    elif previous == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def wait_here(what):
        print(what, flush=True)
        time.sleep(60)

    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(40))
    model.forward = lambda x: [x := b(x) for b in model.blocks][-1]
    model.eval()
    if stop == "enable":
        write = spill.SpillFolder.write
        def slow_write(self, unit):
            image = write(self, unit)
            if self._count == 20:
                wait_here("SPILLING")
            return image
        spill.SpillFolder.write = slow_write
    if stop == "forward":
        model.blocks[25].register_forward_pre_hook(lambda m, a: wait_here("FORWARD"))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake", blocks=["blocks"],
                                         pin_memory=False, host_memory=0, offload_folder=folder)
    if stop == "idle":
        wait_here("ENABLED")
    with torch.no_grad():
        model(torch.randn(2, 32, device=handle.backend.device()))
    if stop == "signalled":
        print("ENABLED", flush=True)
        sys.stdin.readline()
        print("FILES", sum(len(files) for _, _, files in os.walk(folder)), flush=True)
        with torch.no_grad():
            model(torch.randn(2, 32, device=handle.backend.device()))
        print("RAN", flush=True)
""")


def started(tmp_path, stop: str, previous: str = "default") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "spill"), stop, previous],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(child: subprocess.Popen, marker: str) -> None:
    for line in child.stdout:
        if line.strip() == marker:
            return
    raise AssertionError(f"the script ended before {marker}: {child.wait()} {child.stderr.read()}")


def spill_files(tmp_path) -> list[str]:
    return [name for _, _, files in os.walk(tmp_path / "spill") for name in files]


@pytest.mark.parametrize("stop", ["enable", "forward"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_process_ended_by_sigterm_or_sighup_leaves_no_spill_file(signum, stop, tmp_path):
    child = started(tmp_path, stop)
    try:
        wait_for(child, "SPILLING" if stop == "enable" else "FORWARD")
        assert spill_files(tmp_path)  # the blocks are on disk when the signal comes
        child.send_signal(signum)
        assert child.wait(timeout=60) == -signum  # ended by the signal, as without offload-core
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "spill").is_dir() and spill_files(tmp_path) == []


def test_a_handler_the_program_installed_first_decides_and_an_exit_it_makes_removes_the_files(tmp_path):
    child = started(tmp_path, "idle", previous="exits")
    try:
        wait_for(child, "ENABLED")
        assert spill_files(tmp_path)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 3  # the program's handler ran: sys.exit(3)
    finally:
        child.kill()
        child.wait()
    assert spill_files(tmp_path) == []


def test_a_handler_that_keeps_the_process_running_keeps_the_files_it_still_reads(tmp_path):
    child = started(tmp_path, "signalled", previous="records")
    try:
        wait_for(child, "ENABLED")
        child.send_signal(signal.SIGTERM)
        wait_for(child, "HANDLED")
        child.stdin.write("go\n")
        child.stdin.flush()
        files = next(line for line in child.stdout if line.startswith("FILES"))
        assert int(files.split()[1]) == 40
        wait_for(child, "RAN")  # a forward after the signal reads its blocks from the files
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()
    assert spill_files(tmp_path) == []  # removed at exit


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    child = started(tmp_path, "idle", previous="ignored")
    try:
        wait_for(child, "ENABLED")
        child.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)
        assert spill_files(tmp_path)
    finally:
        child.kill()
        child.wait()


# -- descriptors ------------------------------------------------------------------------------
def stack(blocks: int, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
    model.forward = lambda x: [x := b(x) for b in model.blocks][-1]
    return model.eval()


def test_disable_closes_the_spill_files_descriptors_at_once(tmp_path):
    model = stack(12)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    gc.disable()  # what is closed must be closed by disable itself, not by a collection
    try:
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                             blocks=["blocks"], host_memory=0, offload_folder=tmp_path)
        with torch.no_grad():
            assert torch.equal(model(x.to(handle.backend.device())).cpu(), expected)
        assert descriptors_under(tmp_path)  # the forward read the spill files
        handle.disable()
        assert descriptors_under(tmp_path) == []
        assert list(tmp_path.iterdir()) == []
    finally:
        gc.enable()


def test_a_full_disk_gives_back_what_was_written_before_the_error_and_a_retry_with_room_works(tmp_path, monkeypatch):
    model = stack(12)
    before = snapshot(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    room = [5000]  # bytes the disk takes before it is full: a few blocks, the next one half way
    pwrite = os.pwrite

    def filling(fd, data, offset):
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = pwrite(fd, bytes(data)[: room[0]], offset)
        room[0] -= n
        return n

    monkeypatch.setattr(spill.os, "pwrite", filling)
    gc.disable()
    try:
        with pytest.raises(OSError) as full:
            offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                        blocks=["blocks"], host_memory=0, offload_folder=tmp_path)
        assert full.value.errno == errno.ENOSPC
        assert list(tmp_path.iterdir()) == [] and descriptors_under(tmp_path) == []
    finally:
        gc.enable()
    after = snapshot(model)
    for key, (_, value, *_) in before["tensors"].items():
        assert torch.equal(after["tensors"][key][1], value), key
    monkeypatch.setattr(spill.os, "pwrite", pwrite)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         blocks=["blocks"], host_memory=0, offload_folder=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x.to(handle.backend.device())).cpu(), expected)
    handle.disable()
    assert list(tmp_path.iterdir()) == []


BOUNDED = textwrap.dedent("""
    import os, resource, sys
    import torch
    from torch import nn
    import offload_core
    from offload_core.hostmem import descriptors

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    folder = sys.argv[1]

    def open_under():
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith(folder)
            except OSError:
                pass
        return count

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(500))
    model.forward = lambda x: [x := b(x) for b in model.blocks][-1]
    model.eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    peak = []
    for block in model.blocks[::50]:
        block.register_forward_pre_hook(lambda m, a: peak.append(open_under()))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake", blocks=["blocks"],
                                         host_memory=0, offload_folder=folder)
    files = sum(len(f) for _, _, f in os.walk(folder))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x.to(handle.backend.device())).cpu(), expected)
    handle.disable()
    print(files, max(peak), open_under(), descriptors.OPEN_FILES)
""")


def test_500_spilled_blocks_run_under_a_limit_of_256_descriptors_with_a_few_open_at_once(tmp_path):
    done = subprocess.run([sys.executable, "-c", BOUNDED, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    files, peak, after, limit = map(int, done.stdout.split())
    assert files == 500
    assert 0 < peak <= limit + 2  # the stager's and the read-ahead's reads may hold one each beyond the cache
    assert after == 0


def test_the_cache_never_closes_a_descriptor_under_a_read(tmp_path):
    class File:
        def __init__(self, path):
            self.path = str(path)

    files = [File(tmp_path / f"{i}") for i in range(4)]
    for f in files:
        open(f.path, "wb").close()
    cache = descriptors.DescriptorCache(limit=2)
    with cache.reading(files[0]) as held:
        for f in files[1:]:
            with cache.reading(f):
                pass
        os.fstat(held)  # still open: it was in use when the cache made room
        cache.close(files[0])
        os.fstat(held)  # closed when the read ends, not under it
    with pytest.raises(OSError):
        os.fstat(held)
    assert cache.open_count() <= 2


def test_a_forked_child_reads_through_descriptors_of_its_own(tmp_path):
    """The child does not inherit the cache's entries (nor a lock a parent thread may hold)."""
    class File:
        path = str(tmp_path / "weights")

    (tmp_path / "weights").write_bytes(b"abcd")
    file = File()
    with descriptors.DESCRIPTORS.reading(file):
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            ok = False
            try:
                ok = descriptors.DESCRIPTORS.open_count() == 0
                with descriptors.DESCRIPTORS.reading(file) as fd:
                    ok = ok and os.pread(fd, 4, 0) == b"abcd"
            finally:
                os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    descriptors.DESCRIPTORS.close(file)
    assert os.waitstatus_to_exitcode(status) == 0
