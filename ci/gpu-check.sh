#!/usr/bin/env bash
# The first GPU run, for a machine with one NVIDIA GPU, torch preinstalled and no network (about
# 5 minutes on an H200: `python ci/gpu_check.py estimate` says how long each step takes there, from
# the work it does). Nothing is downloaded: the Python given by --python (with its torch) is used
# as it is, and only the wheels carried in --wheels (prepared here by ci/gpu-wheels.sh: diffusers,
# what torch lacks of our imports, the test runner, and offload-core itself as a wheel) are
# installed, with `pip install --no-index --no-deps --target` into a temporary folder. Tests and
# checks then import offload-core from that wheel, never from this checkout. Steps, in order, each
# with a pass/FAIL line; every step runs even if an earlier one failed:
#
#   1. install      the carried wheels, offline;
#   2. environment  torch, CUDA, the device, its PCIe link and NUMA node, the node of the pinned
#                   homes, which version-dependent APIs this torch has;
#   3. kit          the conformance kit (pytest --backend=cuda --pyargs offload_core.testing);
#   4. strategies   the layerwise strategy tests on the device;
#   5. hardware     exactness (layerwise depth 1 and 2, fp32, TF32 off); the crossover sweep
#                   (FLUX.2 single-stream and Wan-14B bf16 blocks at 1k to 64k tokens: resident,
#                   layerwise depth 1 and 2 in frozen(), the planner; step ratio, bound, efficiency,
#                   compute-stream idle time); host cost per block (small Wan blocks, eager and
#                   regionally compiled: offload-core against diffusers' stream path with and
#                   without record_stream); copy/compute overlap; host synchronisations per forward
#                   counted at the backend; H2D bandwidth; pinned bytes against the backend's own
#                   count; mem_get_info; model-level near capacity; stream switches per block;
#                   registered against cached pinned H2D. A profiler trace of each measured step
#                   is kept (trace-*.json);
#   6. realsize     a Wan2.1-1.3B-size transformer run as its pipeline runs it: step ratios to
#                   resident.
#
# The report goes to --out DIR: report.md (the table), report.json, log.txt, what each step wrote,
# and the profiler traces. The exit status is 0 only if every step passed.
#
# Usage: ci/gpu-check.sh [--out DIR] [--wheels DIR] [--python PY] [--dry-run]
#   --out DIR     where the report goes (default: gpu-check-out)
#   --wheels DIR  the carried wheels (default: .whl)
#   --python PY   the Python with torch to use (default: python3)
#   --dry-run     no GPU: the same offline install, then every step on the fake backend; every
#                 hardware check runs on the simulator at tiny sizes, its figures marked simulated
#                 and its speed targets not judged (CI runs this over its oldest torch)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=gpu-check-out
WHEELS=.whl
PY=python3
DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=${2:?--out needs a folder}; shift ;;
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
        --python) PY=${2:?--python needs an interpreter}; shift ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# HF offline: nothing may reach for the hub; PYTHONSAFEPATH: this checkout is never on sys.path
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STEPS="$WORK/steps.tsv"
SITE="$WORK/site"
mkdir -p "$OUT"
rm -f "$OUT"/{report.md,report.json,log.txt,environment.json,kit.xml,strategies.xml,hardware.json,realsize.json} \
    "$OUT"/trace-*.json

# step NAME SECONDS ARTIFACT COMMAND...: run COMMAND with a time limit, log its status and duration
step() {
    local name=$1 limit=$2 artifact=$3 start=$SECONDS status
    shift 3
    echo "== gpu-check: $name"
    timeout "$limit" "$@"
    status=$?
    [ "$status" = 124 ] && echo "== gpu-check: $name exceeded $limit s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$artifact" >> "$STEPS"
    if [ "$status" = 0 ]; then echo "gpu-check: pass: $name"; else echo "gpu-check: FAIL: $name (exit status $status)"; fi
    return "$status"
}

run() {
    local dry=() backend=cuda realsize=(--backend cuda)
    if [ "$DRY" = 1 ]; then
        dry=(--dry-run) backend=fake realsize=(--dry-run)
    fi
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    if [ ${#wheels[@]} = 0 ]; then
        echo "gpu-check: no wheels in $WHEELS: run ci/gpu-wheels.sh first (where PyPI is reachable)"
        return 1
    fi
    if ! step install 45 - "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}"; then
        printf '{"ok": false, "dry_run": %s, "seconds": 0, "steps": {}}\n' "$([ "$DRY" = 1 ] && echo true || echo false)" > "$OUT/report.json"
        echo "gpu-check: the offline install failed; see $OUT/log.txt"
        return 1
    fi
    export PYTHONPATH="$SITE"
    step environment 30 "$OUT/environment.json" \
        "$PY" ci/gpu_check.py environment --site "$SITE" --out "$OUT/environment.json" ${dry[@]+"${dry[@]}"}
    step kit 60 "$OUT/kit.xml" \
        "$PY" -m pytest --backend="$backend" --pyargs offload_core.testing -q --junitxml="$OUT/kit.xml"
    # left out: cosmos3-omni (its tiny tokenizer needs transformers, which is not carried) and the
    # race report's test (it matches source paths inside this checkout; here they are the wheel's)
    step strategies 90 "$OUT/strategies.xml" \
        "$PY" -m pytest --backend="$backend" -q -m "not fake_only" --junitxml="$OUT/strategies.xml" \
        -k "not cosmos3-omni and not test_removing_the_ready_wait_is_reported_as_a_race" \
        tests/strategies/test_layerwise_lifecycle.py tests/strategies/test_layerwise_properties.py tests/strategies/test_layerwise_models.py
    step hardware 300 "$OUT/hardware.json" \
        "$PY" ci/gpu_check.py hardware --out "$OUT/hardware.json" ${dry[@]+"${dry[@]}"}
    step realsize 100 "$OUT/realsize.json" \
        "$PY" -m offload_core.bench.realsize --out "$OUT/realsize.json" "${realsize[@]}"
    "$PY" ci/check_report.py --steps "$STEPS" --out "$OUT/report.json" ${dry[@]+"${dry[@]}"} &&
        "$PY" ci/gpu_check.py table --report "$OUT/report.json" --out "$OUT/report.md" &&
        "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/report.json"
}

run 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
