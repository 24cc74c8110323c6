#!/usr/bin/env bash
# Prepares the wheels that ci/gpu-check.sh installs on a GPU machine with torch preinstalled and
# no network: everything the check imports that torch does not bring, and offload-core itself.
#
# Run it here (it needs PyPI), then copy the repository with its wheel folder to the GPU machine.
# Binary wheels only, no dependencies resolved: the list below is the whole set, checked by
# `ci/gpu-check.sh --dry-run` (CI), which installs exactly these, for this machine's Python, over
# a bare torch. transformers is left out (the check runs no text encoder); a set over 48 MiB is
# refused, so that a dependency that grows is seen (it is 40 MiB for Python 3.11).
#
# Usage: ci/gpu-wheels.sh [--python-version X.Y] [--dest DIR]
#   --python-version X.Y  the Python of the machine that installs them (default: 3.12, the GPU
#                         machine's); CI passes its own for the dry run
#   --dest DIR            where the wheels go (default: .whl, ignored by git); emptied first
set -euo pipefail
cd "$(dirname "$0")/.."

PYV=3.12
DEST=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYV=${2:?--python-version needs X.Y}; shift ;;
        --dest) DEST=${2:?--dest needs a folder}; shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-wheels: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# The versions CI tests with (the same as its virtual environment's), grouped by who imports them.
WHEELS=(
    # offload-core's own imports (tokenizers: the tiny models' tokenizers, which bench imports)
    pluggy==1.7.0 safetensors==0.8.0 tqdm==4.70.1 psutil==7.2.2 tokenizers==0.23.3
    # diffusers and what it imports at import time
    diffusers==0.42.1 huggingface_hub==2.4.0 numpy==2.4.6 pillow==13.0.0 regex==2026.11.19
    requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
    importlib_metadata==10.2.0 zipp==4.1.2 packaging==26.4 PyYAML==6.0.4
    httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 truststore==0.10.5
    # diffusers' group offloading, which the real-size benchmark compares with
    accelerate==1.15.0
    # the test runner
    pytest==9.2.0 iniconfig==2.3.1 Pygments==2.21.0 hypothesis==6.170.17 sortedcontainers==2.4.0
)

rm -rf "$DEST" build  # build/: setuptools would carry files deleted since into the wheel
mkdir -p "$DEST"
# every manylinux tag up to glibc 2.28, by name: older pips do not widen one --platform to the rest
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" "${PLATFORMS[@]}" \
    -d "$DEST" "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps -w "$DEST" .

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu-wheels: $(ls "$DEST" | wc -l) wheels for Python $PYV in $DEST, $((total / 1048576)) MiB:" >&2
ls "$DEST" >&2
if [ "$total" -gt $((48 * 1048576)) ]; then
    echo "gpu-wheels: more than 48 MiB: which wheel grew?" >&2
    exit 1
fi
