#!/usr/bin/env bash
# Downloads the wheels the GPU check uses but a GPU machine without network lacks, into .whl/
# of this checkout (git-ignored): torchao, for the fp8 part's side by side with torchao's float8
# training. scripts/gpu_check.sh installs whatever it finds in .whl/ into a temporary folder.
#
#   scripts/fetch_gpu_wheels.sh [--python-version 3.12] [--platform manylinux_2_28_x86_64]
#
# The wheels are for the GPU machine, not this one: CPython 3.12 on manylinux x86_64 by
# default (pip download --no-deps --only-binary=:all:). torchao 0.17.0 is the release built
# against torch 2.11 (and ABI-stable from there on); its float8 training
# (torchao.float8.convert_to_float8_training) is what the check compares with. The wheel is
# about 3 MB: a copy of the working tree that carries .whl/ stays far under 64 MiB.
#
# Needs pip and the network (a package index); exit status 0 when every wheel is in .whl/.
set -euo pipefail

TORCHAO=${TORCHAO:-torchao==0.17.0}
python_version=3.12
platform=manylinux_2_28_x86_64
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) python_version=$2; shift ;;
        --platform) platform=$2; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "fetch_gpu_wheels.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
    shift
done

cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
mkdir -p .whl
"$py" -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform "$platform" --dest .whl "$TORCHAO"
ls -l .whl/*.whl
echo "total: $(du -sh .whl | cut -f1) in .whl/ (carry it with the working tree: it is git-ignored)"
