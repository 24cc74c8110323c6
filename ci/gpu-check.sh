#!/usr/bin/env bash
# The one prepared check for a machine with one NVIDIA GPU and this repository (under 8 minutes):
#
#   1. install: a fresh virtual environment (.venv-gpu-check) with a CUDA build of torch 2.13.0
#      (index: $TORCH_INDEX_URL, default CUDA 12.8) and this package with its test extras;
#   2. kit: the backend conformance kit, pytest --backend=cuda --pyargs offload_core.testing;
#   3. strategies: the backend-generic strategy tests with --backend=cuda (tests marked fake_only,
#      or needing a capability CUDA lacks, are skipped by the pytest plugin);
#   4. bench: offload-core bench --quick (the simulator's figures, as a regression record);
#   5. realsize: a Wan2.1-1.3B-config transformer, bf16, 480x832x81 latent: resident, layerwise at
#      depths 1 and 2, diffusers group offloading; step ratios, H2D GB/s against a pinned copy,
#      device peaks, real pinned bytes (python -m offload_core.bench.realsize);
#
# and writes everything as one JSON file (python -m offload_core.bench.check_report). Every step
# runs even if an earlier one failed; the exit status is 0 only if all passed.
#
# Usage: ci/gpu-check.sh [--out FILE.json] [--reuse-venv] [--dry-run]
#   --out FILE.json  where the report goes (default: gpu-check.json)
#   --reuse-venv     keep an existing .venv-gpu-check instead of building a fresh one
#   --dry-run        no GPU, no venv, no downloads: every step on the fake backend in the current
#                    Python environment, tests reduced to a smoke selection, the benchmark at tiny
#                    sizes (CI runs this so that the script keeps working)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=gpu-check.json
DRY=0
REUSE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=${2:?--out needs a file name}; shift ;;
        --reuse-venv) REUSE=1 ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STEPS="$WORK/steps.tsv"
: > "$STEPS"

# step NAME SECONDS ARTIFACT COMMAND...: run COMMAND with a time limit, log its status and duration
step() {
    local name=$1 limit=$2 artifact=$3 start=$SECONDS status
    shift 3
    echo "== gpu-check: $name" >&2
    timeout "$limit" "$@"
    status=$?
    [ "$status" = 124 ] && echo "== gpu-check: $name exceeded $limit s" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$artifact" >> "$STEPS"
    return "$status"
}

STRATEGY_TESTS=(tests/test_layerwise_models.py tests/test_layerwise_properties.py
                tests/test_layerwise_lifecycle.py tests/test_pipelines.py)

if [ "$DRY" = 1 ]; then
    PY=python3
    command -v python >/dev/null && PY=python
    BACKEND=fake
    KIT_SELECT=(-k test_identity)
    STRATEGY_TESTS=(tests/test_layerwise_lifecycle.py)
    STRATEGY_SELECT=(-k "test_disable_restores or test_state_dict")
    BENCH_SELECT=(--only copies_per_block)
    REALSIZE=(--dry-run)
else
    VENV=.venv-gpu-check
    PY=$VENV/bin/python
    BACKEND=cuda
    KIT_SELECT=()
    STRATEGY_SELECT=()
    BENCH_SELECT=()
    REALSIZE=(--backend cuda)
    export VENV PY REUSE TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}
    # shellcheck disable=SC2016  # expanded by the inner shell
    INSTALL='
        if [ "$REUSE" = 1 ] && [ -x "$PY" ]; then
            echo "reusing $VENV" >&2
        else
            rm -rf "$VENV" && python3 -m venv "$VENV" &&
                "$VENV/bin/pip" install -q torch==2.13.0 --index-url "$TORCH_INDEX_URL" &&
                "$VENV/bin/pip" install -q -e ".[test]" || exit 1
        fi
        "$PY" -c "import torch; assert torch.cuda.is_available(), f\"torch {torch.__version__} sees no CUDA device\"; print(torch.__version__, torch.cuda.get_device_name(0))"'
    if ! step install 150 - bash -c "$INSTALL"; then
        status=$(cut -f2 "$STEPS")
        printf '{"ok": false, "dry_run": false, "steps": {"install": {"ok": false, "exit_status": %s}}}\n' "$status" > "$OUT"
        echo "gpu-check: installation failed (exit status $status); see $OUT" >&2
        exit 1
    fi
fi

step kit 45 "$WORK/kit.xml" \
    "$PY" -m pytest --backend="$BACKEND" --pyargs offload_core.testing -q --junitxml="$WORK/kit.xml" ${KIT_SELECT[@]+"${KIT_SELECT[@]}"}
step strategies 120 "$WORK/strategies.xml" \
    "$PY" -m pytest --backend="$BACKEND" -q -m "not fake_only" --junitxml="$WORK/strategies.xml" \
    ${STRATEGY_SELECT[@]+"${STRATEGY_SELECT[@]}"} "${STRATEGY_TESTS[@]}"
step bench 45 "$WORK/bench.json" \
    "$PY" -m offload_core bench --quick --json --out "$WORK/bench.json" ${BENCH_SELECT[@]+"${BENCH_SELECT[@]}"} > /dev/null
step realsize 120 "$WORK/realsize.json" \
    "$PY" -m offload_core.bench.realsize --out "$WORK/realsize.json" "${REALSIZE[@]}"

DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry-run)
"$PY" -m offload_core.bench.check_report --steps "$STEPS" --out "$OUT" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}
