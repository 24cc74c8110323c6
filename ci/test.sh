#!/usr/bin/env bash
# CI: a fresh virtual environment, the pinned CPU torch, the package with its test extras, then
# exactly the test command of README.md, then the mutation run that shows every synchronisation
# in the strategies is covered by a test (7 to 11 minutes on 2 cores; see docs/design.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
rm -rf .venv
python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && pytest --backend=fake
python ci/mutants.py
