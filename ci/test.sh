#!/usr/bin/env bash
# CI: a fresh virtual environment, the pinned CPU torch, the package with its test extras, then
# exactly the test command of README.md, then the mutation run that shows every synchronisation
# in the strategies is covered by a test (on 2 cores, 2026-12-05: the suite 19.7 minutes, the
# mutation run 8.9; see docs/design.md).
#
# Then the oldest torch pyproject.toml declares, run through the GPU check's dry run: a bare
# virtual environment with only that torch (PyPI's build, whose CUDA libraries import without a
# GPU; about 2.5 minutes to install here), the same offline install of the carried wheels as on
# the GPU machine (built for this Python), then every step on the fake backend: the conformance
# kit, the layerwise strategy tests, every hardware check on the simulator, the real-size
# benchmark's dry run (2 minutes at load average 6, 4 at 7 to 9, on 2026-12-04 and 05). The whole
# run took 33.1 minutes on 2026-12-05 (13:14 to 13:47 UTC), in a clean clone with nothing else running.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
rm -rf .venv
python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && pytest --backend=fake
python ci/mutants.py

OLDEST=$(python -c 'import re, tomllib; print(re.search(r"torch>=([0-9.]+)", " ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))[1])')
rm -rf .venv-oldest
python3 -m venv .venv-oldest && .venv-oldest/bin/pip install -q "torch==$OLDEST"
ci/gpu-wheels.sh --python-version "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" --dest .whl-dry-run
ci/gpu-check.sh --dry-run --python .venv-oldest/bin/python --wheels .whl-dry-run --out out/gpu-check-dry-run
