"""Every synchronisation in the strategies is covered by a test: delete each one, see a test fail.

Each mutant below removes (or weakens) one synchronisation statement (an event record or wait, a
``wait_stream``, a stream or event synchronize) or one piece of slot / ready bookkeeping, in
``offload_core/strategies/`` or ``offload_core/discovery/pipelines.py``, runs the focused tests named
beside it on the fake backend (chaos mode and the race sanitizer on), and expects them to fail.
The list is written out here on purpose: a new synchronisation statement without a mutant makes
this script fail ("not covered"), so adding one is visible in review.

    python ci/mutants.py            # every mutant; prints a table; exit 1 if one survives
    python ci/mutants.py -k freed   # only mutants whose name contains "freed"

The source files are edited in place and restored after each mutant (also on Ctrl-C or SIGTERM);
run it on a clean checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRATEGY_FILES = sorted((ROOT / "offload_core" / "strategies").glob("*.py")) + [
    ROOT / "offload_core" / "discovery" / "pipelines.py", ROOT / "offload_core" / "hostmem" / "staging.py",
]
#: statements that order work or hand memory over; each must be the target of a mutant
SYNC = re.compile(r"\.(wait|record|synchronize)\b|wait_stream\(|release_all\(\)$")

LIFECYCLE = "tests/strategies/test_layerwise_lifecycle.py"
STRATEGIES = "tests/strategies/test_sanitizer_strategies.py"
PROPERTIES = "tests/strategies/test_layerwise_properties.py"
LAYERWISE_MODELS = "tests/strategies/test_layerwise_models.py"
PIPELINES = "tests/strategies/test_pipelines.py"
MODEL_LEVEL = "tests/strategies/test_model_level.py"
GRAD_MODE = "tests/contract/test_grad_mode_leaks.py"
SAVED_READ = f"{GRAD_MODE}::test_a_released_saved_weight_read_outside_backward_is_a_copy_and_leaves_nothing_on_the_device"
CHAINED_BACKWARD = f"{GRAD_MODE}::test_model_level_releases_the_device_copy_a_live_graph_saved_at_the_next_load_and_at_disable"
DISTRIBUTED = "tests/strategies/test_distributed.py::test_distributed_layerwise_on_two_ranks"
CHANGES = "tests/contract/test_contract_changes.py::test_a_change_between_forwards_acts_as_without_offload"
LORA = "tests/contract/test_contract_lora.py"
CALLBACK_DISABLE = "tests/contract/test_contract_failures.py::test_disable_from_a_step_callback_finishes_the_call_without_offload"
SHARDED = "tests/contract/test_contract_distributed.py::test_sharded_ranks_agree_fail_together_and_never_mix_blocks"
REUSE = "tests/strategies/test_layerwise_lifecycle.py::test_first_copies_are_ordered_after_compute_on_reused_device_memory"
CHILD_ALONE = "tests/contract/test_contract_failures.py::test_a_component_child_called_alone_leaves_the_device_after_it"
WRITE_AFTER_FORWARD = "tests/contract/test_contract_changes.py::test_writes_right_after_a_forward_wait_for_the_copies_that_read_the_host"
STAGED = "tests/hostmem/test_hostmem.py::test_a_pinned_budget_stages_the_other_blocks_through_the_bounce_ring_exactly"
STAGED_PIPELINE = "tests/hostmem/test_hostmem.py::test_pipeline_components_without_pinned_memory_are_staged_exactly"
STAGED_RESIDENT = "tests/hostmem/test_hostmem.py::test_resident_components_are_on_the_device_when_enable_returns"
STAGED_LAYERWISE_RESIDENT = "tests/hostmem/test_hostmem.py::test_a_staged_resident_part_is_on_the_device_when_enable_returns"
STAGED_DISABLE = "tests/hostmem/test_hostmem.py::test_disable_unpacks_only_once_every_load_handed_to_the_stager_is_issued"
TRAINING = "tests/training/test_autograd.py::test_weight_gradients_and_optimizer_steps_update_the_host_truth"
NEW_SLOT = "tests/training/test_autograd.py::test_a_new_slot_is_filled_after_compute_on_memory_it_may_reuse"
LET_GO = "tests/training/test_autograd.py::test_a_view_a_finished_transfer_lets_go_of_at_synchronize_is_not_a_kept_slot"
NEW_DATA_MID_PASS = ("tests/contract/test_edits_saves_and_lifetime.py::"
                     "test_a_block_hook_that_gives_the_next_block_new_data_is_seen")
OPTIMIZER_IN_BACKWARD = "tests/training/test_training_edges.py::test_an_optimizer_stepping_each_weight_in_backward_is_exact_and_race_free"
PHASES_I2V = "tests/planner/test_phases.py::test_each_phase_copies_loads_and_reads_what_its_plan_says[wan2.2-i2v]"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    statement: str  # the statement's code (no comment), stripped; must occur exactly ``occurrences`` times
    tests: tuple[str, ...]
    replacement: str = "pass"
    occurrence: int = 0  # which occurrence to mutate, when the text occurs more than once
    occurrences: int = 1


C = "offload_core/strategies/part.py"
L = "offload_core/strategies/layerwise.py"
LOADER = "offload_core/strategies/loader.py"
PASSES = "offload_core/strategies/passes.py"
CHECKS = "offload_core/strategies/checks.py"
M = "offload_core/strategies/model_level.py"
MC = "offload_core/strategies/model_calls.py"
MS = "offload_core/strategies/model_saved.py"
G = "offload_core/strategies/gather.py"
RING = "offload_core/strategies/ring.py"
R = "offload_core/strategies/resident.py"
H = "offload_core/strategies/held.py"
S = "offload_core/hostmem/staging.py"

MUTANTS = [
    # -- layerwise ----------------------------------------------------------------------------
    Mutant("layerwise: first copies wait for earlier compute (new buffers may reuse its memory)", L,
           "backend.wait_stream(self.copy_stream, backend.current_stream())", (STRATEGIES, REUSE)),
    Mutant("layerwise: resident copy's done event recorded", L, "done.record(self.copy_stream)", (LIFECYCLE,)),
    Mutant("layerwise: host waits for the resident copy before binding", L, "done.synchronize()", (LIFECYCLE,)),
    Mutant("layerwise: the host waits for queued copies before it may write host memory (end of a forward, "
           "disable)", LOADER, "self.copy_stream.synchronize()", (WRITE_AFTER_FORWARD,)),
    Mutant("layerwise: a slot is judged kept only once finished transfers let go of it (a collective's work)", RING,
           "copy_stream.synchronize()", (LET_GO,)),
    Mutant("layerwise: a gradient reaches its weight only after the block's latest load (an optimizer in "
           "backward steps the home a copy may still read)", PASSES, "ready.synchronize()", (OPTIMIZER_IN_BACKWARD,)),
    Mutant("layerwise: a copy into a slot waits for the slot's free event", LOADER, "self.ring.wait_free(record.slot, stream)",
           (STRATEGIES,)),
    Mutant("ring: waiting for a slot's free event", RING, "self._freed[slot].wait(stream)", (STRATEGIES,)),
    Mutant("layerwise: the slot's occupant is recorded", LOADER, "ring.claim(slot, i)", (PROPERTIES,)),
    Mutant("layerwise: the block's ready event is recorded after its copies", LOADER, "record.ready.record(stream)",
           (LIFECYCLE,)),
    Mutant("layerwise: compute waits for the block's ready event", LOADER, "record.ready.wait(stream)", (LIFECYCLE,)),
    Mutant("layerwise: a reader other than compute waits for the block's ready event", LOADER,
           "record.ready.wait(reader)", (DISTRIBUTED,)),
    Mutant("layerwise: the slot of a block that ran is marked free", PASSES,
           "loader.ring.mark_free(record.slot, self.backend.current_stream())", (STRATEGIES, LIFECYCLE)),
    Mutant("ring: marking a slot free records its event", RING, "self._freed[slot].record(stream)",
           (STRATEGIES, LIFECYCLE)),
    Mutant("layerwise: a block given new data after its load was queued is loaded again", CHECKS, "loader.load(i)",
           (NEW_DATA_MID_PASS,)),
    Mutant("layerwise: a block called out of order is loaded", PASSES, "loader.load(i)", (LIFECYCLE,)),
    Mutant("layerwise backward: a slot is refilled only after the backward that read it", LOADER,
           "ring.mark_free(ring.slot_of(i), self.backend.current_stream())", (TRAINING,)),
    Mutant("layerwise backward: a block whose weights backward needs is loaded", LOADER, "self.load(i)", (TRAINING,),
           occurrence=0, occurrences=2),
    Mutant("layerwise backward: its end marks every slot free for the next forward's copies", RING,
           "freed.record(stream)", (TRAINING,)),
    Mutant("layerwise: a new slot (the old one kept by its holder) is filled after earlier compute", RING,
           "self.backend.wait_stream(copy_stream, self.backend.current_stream())", (NEW_SLOT,)),
    Mutant("layerwise: a block shows its slot only while it runs", PASSES, "loader.records[i].binding.to_device()", (LIFECYCLE,)),
    # -- changes copied home ------------------------------------------------------------------
    Mutant("write-back: the event after the copies home is recorded", C, "done.record(stream)", (CHANGES,)),
    Mutant("write-back: the host waits for the copies home", C, "done.synchronize()", (CHANGES,)),
    Mutant("layerwise: the resident weights' copy is issued (by the stager) before its done event", H,
           "placement.wait(copy_unit(unit, buffers, placement, stream, counters))", (STAGED_LAYERWISE_RESIDENT,),
           replacement="copy_unit(unit, buffers, placement, stream, counters)"),
    Mutant("layerwise: compute waits for a staged load's ticket before its ready event", LOADER,
           "self.part.placement.wait(ticket)", (STAGED,)),
    # -- distributed --------------------------------------------------------------------------
    Mutant("distributed: the slot is used only after its all-gather", G,
           "backend.all_gather_into_tensor(out, staging, self.group, stream).wait(stream)", (DISTRIBUTED,),
           replacement="backend.all_gather_into_tensor(out, staging, self.group, stream)"),
    Mutant("distributed: a load's header is gathered before its data", G, "gathered.wait(stream)", (SHARDED,)),
    Mutant("distributed: the host waits for the gathered headers before reading them", G,
           "at.copy_stream.synchronize()", (SHARDED,)),
    Mutant("distributed: a shard takes a forward's buffer changes only once they have landed", G,
           "done.synchronize()", (SHARDED,)),
    Mutant("distributed: the event after a shard's update is recorded", G, "done.record(stream)", (SHARDED,)),
    Mutant("distributed disable: the read-back waits for the block's gather", LOADER, "self.wait_ready(i, reader)",
           (DISTRIBUTED,)),
    Mutant("distributed disable: host waits for the read-back", G, "reader.synchronize()", (DISTRIBUTED,)),
    # -- model-level --------------------------------------------------------------------------
    Mutant("model-level: disable swaps every group home, also in the middle of a call", M, "self.release_all()",
           (CALLBACK_DISABLE,)),
    Mutant("model-level: a pipeline call's groups leave the device when it ends", MC, "self.release_all()",
           (PIPELINES, MODEL_LEVEL, LORA), occurrence=0, occurrences=4),
    Mutant("model-level: a component called on its own leaves the device after its forward", MC,
           "self.release_all()", (MODEL_LEVEL,), occurrence=1, occurrences=4),
    Mutant("model-level: a child called on its own (vae.decode) leaves the device after it", MC,
           "self.release_all()", (CHILD_ALONE,), occurrence=2, occurrences=4),
    Mutant("model-level: a staged group leaves the device when another phase begins", MC, "self.release_all()",
           (PHASES_I2V,), occurrence=3, occurrences=4),
    Mutant("model-level: a saved weight read outside a backward leaves its group home again", MS,
           "self.release_all()", (SAVED_READ,), occurrence=0, occurrences=2),
    Mutant("model-level: a backward that made a group active sends it home when it ends", MS,
           "self.release_all()", (CHAINED_BACKWARD,), occurrence=1, occurrences=2),
    Mutant("model-level: compute waits for the group's ready event", M, "group.ready.wait(compute)", (PIPELINES, MODEL_LEVEL)),
    Mutant("model-level: a staged group's ticket is waited before its ready event", M,
           "self.placement.wait(ticket)", (STAGED_PIPELINE,)),
    Mutant("model-level: a group's copies wait for earlier compute (the free wait)", M,
           "freed.wait(stream)", (STRATEGIES,)),
    Mutant("model-level: the group's ready event is recorded after its copies", M,
           "group.ready.record(stream)", (PIPELINES, MODEL_LEVEL)),
    Mutant("model-level: the free event is recorded after all compute issued", M,
           "event.record(self.backend.current_stream())", (STRATEGIES,)),
    Mutant("model-level: swapping a group out waits for its copies before the host may write its home", M,
           "(group.ready if group.recorded else self.copy_stream).synchronize()", (PIPELINES, MODEL_LEVEL, LORA)),
    Mutant("model-level: a group is marked active once bound", M, 'group.state = "active"', (PIPELINES, MODEL_LEVEL)),
    Mutant("model-level: a swapped-out group is marked on the host", M, 'group.state = "host"', (PIPELINES, MODEL_LEVEL)),
    # -- resident modules and pipelines ------------------------------------------------------
    Mutant("resident: copies wait for earlier compute", R,
           "self.backend.wait_stream(stream, self.backend.current_stream())", (STRATEGIES, REUSE)),
    Mutant("resident: host waits for the copies before binding", R, "stream.synchronize()", (PIPELINES, MODEL_LEVEL)),
    Mutant("resident: a staged copy is issued before the host waits for the stream", R,
           "self.placement.wait(copy_unit(unit, buf, self.placement, stream, self.counters))", (STAGED_RESIDENT,),
           replacement="copy_unit(unit, buf, self.placement, stream, self.counters)"),
    # -- the bounce ring ----------------------------------------------------------------------
    Mutant("bounce ring: a buffer is refilled only after the copy that read it", S,
           "self.read_done[k].synchronize()", (STAGED,)),
    Mutant("bounce ring: the read of a buffer is marked by an event", S, "self.read_done[k].record(stream)", (STAGED,)),
    Mutant("stager: waiting for a load's ticket blocks until the load is issued", S, "ticket._done.wait()",
           (STAGED,)),
    Mutant("stager: drain blocks until every submitted load is issued", S,
           "self.submit(lambda: None)._done.wait()", (STAGED_DISABLE,)),
]


def covered_lines() -> set[tuple[str, int]]:
    """(path, line number) of every mutant's target, checking each statement occurs as declared."""
    lines: set[tuple[str, int]] = set()
    for m in MUTANTS:
        found = _occurrences(m)
        if len(found) != m.occurrences:
            raise SystemExit(f"mutant {m.name!r}: {m.statement!r} occurs {len(found)} times in {m.path}, "
                             f"expected {m.occurrences}; update ci/mutants.py")
        lines.add((m.path, found[m.occurrence] + 1))
    return lines


def _occurrences(m: Mutant) -> list[int]:
    text = (ROOT / m.path).read_text().splitlines()
    return [i for i, line in enumerate(text) if _code(line) == m.statement]


def _code(line: str) -> str:
    """A line without its comment and indentation (statements here hold no '#' in strings)."""
    return line.split("  #", 1)[0].strip()


def uncovered() -> list[str]:
    """Synchronisation statements no mutant targets."""
    covered = covered_lines()
    missing = []
    for path in STRATEGY_FILES:
        rel = str(path.relative_to(ROOT))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = _code(line)
            if SYNC.search(code) and not code.startswith(("def ", "class ")) and (rel, number) not in covered:
                missing.append(f"{rel}:{number}: {code}")
    return missing


def run(m: Mutant, timeout: float) -> tuple[str, str, float]:
    """Apply one mutant, run its tests, restore. Returns (verdict, detail, seconds)."""
    path = ROOT / m.path
    original = path.read_text()
    lines = original.splitlines(keepends=True)
    index = _occurrences(m)[m.occurrence]
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    lines[index] = f"{indent}{m.replacement}  # MUTANT\n"
    start = time.monotonic()
    try:
        path.write_text("".join(lines))
        cmd = [sys.executable, "-m", "pytest", "--backend=fake", "-x", "-q", "-p", "no:randomly", "--tb=line",
               "-W", "ignore", *m.tests]
        try:
            # faulthandler: a process that dies of a signal shows every thread's stack
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        except subprocess.TimeoutExpired:
            return "killed", "timed out (a hang counts as detected)", time.monotonic() - start
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 1:
        return "killed", failed[0] if failed else "tests failed", seconds
    if proc.returncode == 0:
        return "SURVIVED", "all named tests passed", seconds
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode < 0 and failed:  # a test failed, then the broken code took the process down
        return "killed", f"{failed[0]} (then pytest died of signal {-proc.returncode}: {tail[-1]})", seconds
    return "ERROR", f"pytest exit {proc.returncode}:\n    " + "\n    ".join(tail[-40:] or ["?"]), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this text")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run")
    args = parser.parse_args(argv)
    missing = uncovered()
    if missing:
        print("synchronisation statements without a mutant (add them to ci/mutants.py):", *missing, sep="\n  ")
        return 1
    chosen = [m for m in MUTANTS if args.k in m.name]
    if not chosen:
        print(f"no mutant name contains {args.k!r}")
        return 1
    width = max(len(m.name) for m in chosen)
    print(f"{'mutant':<{width}}  verdict   seconds  test that failed")
    bad = 0
    total = time.monotonic()
    for m in chosen:
        verdict, detail, seconds = run(m, args.timeout)
        bad += verdict != "killed"
        print(f"{m.name:<{width}}  {verdict:<8}  {seconds:7.1f}  {detail}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutants killed in {time.monotonic() - total:.0f} s")
    return 1 if bad else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through run(), which restores the file


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
