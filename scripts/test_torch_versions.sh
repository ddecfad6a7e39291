#!/usr/bin/env bash
# The whole test suite on each supported torch release, each in a throwaway virtual
# environment, then one table (Markdown, for README's "Supported torch").
#
#   scripts/test_torch_versions.sh                  # 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
#   scripts/test_torch_versions.sh 2.12.1 2.15.0    # some of them
#
# Each torch comes from the package index (on Linux every release but the 2.13.0 CPU
# build this project's machines keep on disk is a CUDA build, several GB with its CUDA
# packages; it runs on a CPU). The project and its test extras are then installed next
# to it with torch pinned to the installed build, and the script checks that torch is
# unchanged. Environment:
#   VENV_ROOT    where the environments go (default: a temporary folder, removed at the end)
#   KEEP_VENVS=1 keep them (to rerun tests in one: VENV_ROOT/<version>/bin/python -m pytest)
#   PYTEST_ARGS  extra pytest arguments (e.g. "tests/autocast/test_policy.py")
#   LOG_DIR      where each version's install and pytest logs go (default: VENV_ROOT/logs)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)

root=${VENV_ROOT:-$(mktemp -d -t dispatch-amp-torch-XXXX)}
mkdir -p "$root"
logs=${LOG_DIR:-$root/logs}
mkdir -p "$logs"
if [ -z "${VENV_ROOT:-}" ] && [ "${KEEP_VENVS:-0}" != 1 ]; then
    trap 'rm -rf "$root"' EXIT
fi

seconds_since() { echo $(( $(date +%s) - $1 )); }

rows=()
for version in "${versions[@]}"; do
    env_dir=$root/$version
    log=$logs/$version
    echo "== torch $version: $env_dir (logs: $log.*)" >&2
    rm -rf "$env_dir"
    python3 -m venv "$env_dir"
    py=$env_dir/bin/python
    "$py" -m pip install --quiet --upgrade pip >"$log.install.log" 2>&1

    start=$(date +%s)
    if ! "$py" -m pip install --quiet "torch==$version" >>"$log.install.log" 2>&1; then
        rows+=("| $version | - | - | - | - | - | torch did not install (see $log.install.log) |")
        continue
    fi
    torch_s=$(seconds_since "$start")
    # The distribution's version (what pip matches), not torch.__version__ ("2.11.0+cu130").
    installed=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')

    start=$(date +%s)
    # Pinning the installed build makes "never changes torch" a hard requirement: pip
    # fails rather than replace it.
    if ! "$py" -m pip install --quiet -e "$repo[test]" "torch==$installed" >>"$log.install.log" 2>&1; then
        rows+=("| $installed | - | - | $torch_s | - | - | the project did not install next to it (see $log.install.log) |")
        continue
    fi
    project_s=$(seconds_since "$start")
    after=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')
    if [ "$after" != "$installed" ]; then
        rows+=("| $installed | - | - | $torch_s | $project_s | - | installing the project changed torch to $after |")
        continue
    fi
    read -r build triton numpy < <("$py" -c '
import numpy, torch
try:
    import triton; t = triton.__version__
except ImportError:
    t = "-"
print("CUDA-" + torch.version.cuda if torch.version.cuda else "CPU", t, numpy.__version__)')

    start=$(date +%s)
    # shellcheck disable=SC2086
    (cd "$repo" && "$py" -m pytest -p no:cacheprovider --junitxml="$log.junit.xml" ${PYTEST_ARGS:-}) \
        >"$log.pytest.log" 2>&1
    tests_s=$(seconds_since "$start")
    counts=$("$py" - "$log.junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    suites = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("no report"); raise SystemExit
suites = [suites] if suites.tag == "testsuite" else list(suites)
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
)
    rows+=("| $installed | $build | $triton / $numpy | $torch_s | $project_s | $tests_s | $counts |")
done

echo
echo "Run on $(date -u +%Y-%m-%d), $(nproc) CPU cores, Python $(python3 -c 'import platform; print(platform.python_version())')."
echo
echo "| torch | build | triton / numpy | install torch (s) | install project (s) | tests (s) | result |"
echo "|---|---|---|---:|---:|---:|---|"
printf '%s\n' "${rows[@]}"
