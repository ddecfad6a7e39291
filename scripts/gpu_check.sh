#!/usr/bin/env bash
# The GPU check, one command for a machine with a CUDA GPU and no network: the CUDA test
# lane (tests/cuda) and the benchmarks on the GPU (python -m benchmarks --device cuda),
# written to one Markdown report.
#
#   scripts/gpu_check.sh [--quick] [--tests-only | --bench-only]
#
#   --quick       pass --quick to the benchmarks (tiny sizes: a smoke test of the GPU paths)
#   --tests-only  only the CUDA test lane
#   --bench-only  only the benchmarks
#
# Installs nothing from the network: it uses the python that holds torch (PYTHON, else the
# first of python3, python, .venv/bin/python that imports torch) and the packages there. The repository is made importable
# as dispatch_amp (src/dispatch_amp, with the top-level kernels/ as dispatch_amp.kernels,
# the mapping in pyproject.toml) in this order: as it already is, if it already resolves to
# this checkout; `pip install --no-deps --no-build-isolation --no-index -e .`; else a
# symlink tree in a temporary folder on PYTHONPATH (nothing written outside it).
#
# Report: $OUT/gpu_report.md when OUT is set, else ${REPORT:-gpu_report.md}; beside it the
# pytest log and junit XML, the benchmarks' stderr and their CSV files (a .tar.gz under
# OUT). The report is written as the run goes, so a run cut short still leaves its start.
# Environment: TEST_TIMEOUT (s, default 1500), BENCH_TIMEOUT (s, default 900), PYTEST_ARGS
# (extra pytest arguments).
#
# Exit status: 0 all passed; 1 a test failed or a benchmark suite failed (the benchmarks
# still run and the report is still written when the tests fail); 2 not a GPU machine (no
# CUDA device visible to torch), no torch, or a usage error.
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

quick=0 tests=1 bench=1
for arg in "$@"; do
    case $arg in
        --quick) quick=1 ;;
        --tests-only) bench=0 ;;
        --bench-only) tests=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done
if [ "$tests" = 0 ] && [ "$bench" = 0 ]; then
    echo "gpu_check.sh: --tests-only and --bench-only exclude each other" >&2
    exit 2
fi

invoked_from=$(pwd)
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd -P)

# `timeout` where coreutils has it, else the command as it is.
with_timeout() {
    local secs=$1
    shift
    if command -v timeout >/dev/null 2>&1; then timeout "$secs" "$@"; else "$@"; fi
}

py=${PYTHON:-}
if [ -z "$py" ]; then  # the first that imports torch
    for candidate in python3 python "$repo/.venv/bin/python"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch' >/dev/null 2>&1; then
            py=$candidate
            break
        fi
    done
fi
if [ -z "$py" ] || ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "gpu_check.sh: no python with torch found (PYTHON=${PYTHON:-unset}); set PYTHON to the interpreter that holds torch." >&2
    exit 2
fi

# -- a GPU machine? -------------------------------------------------------------------------
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    build=$("$py" -c 'import torch; print(torch.__version__, "(CUDA " + torch.version.cuda + " build)" if torch.version.cuda else "(a CPU-only build)")' 2>/dev/null)
    echo "gpu_check.sh: no CUDA GPU is visible to torch here (torch $build): this script is for GPU machines." >&2
    echo "  On a machine without a GPU run the CPU checks instead: python -m pytest; python -m benchmarks --quick." >&2
    exit 2
fi

# -- where the report goes ------------------------------------------------------------------
tmp=$(mktemp -d -t gpu-check-XXXXXX) || exit 2
trap 'rm -rf "$tmp"' EXIT
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    report=$OUT/$(basename "${REPORT:-gpu_report.md}")
else
    report=${REPORT:-gpu_report.md}
    case $report in /*) ;; *) report=$invoked_from/$report ;; esac  # relative to where it was run
    mkdir -p "$(dirname "$report")"
fi
stem=${report%.md}
pytest_log=$stem.pytest.log
junit=$stem.junit.xml
bench_err=$stem.bench.stderr.log
: >"$report"
say() { printf '%s\n' "$*" | tee -a "$report"; }
note() { printf '%s\n' "$*" >&2; }

# -- dispatch_amp importable from this checkout ----------------------------------------------
# Prints nothing on success; exit 1 unless dispatch_amp and dispatch_amp.kernels are this
# checkout's src/dispatch_amp and kernels/.
resolves_here() {
    (cd "$tmp" && "$py" - "$repo" <<'PY'
import os, sys
repo = sys.argv[1]
try:
    import dispatch_amp, dispatch_amp.kernels
except Exception:
    sys.exit(1)
want = {os.path.join(repo, "src", "dispatch_amp"), os.path.join(repo, "kernels")}
got = {os.path.dirname(os.path.realpath(m.__file__)) for m in (dispatch_amp, dispatch_amp.kernels)}
sys.exit(0 if got == want else 1)
PY
    ) >/dev/null 2>&1
}

how=""
if resolves_here; then
    how="already importable from this checkout"
elif "$py" -m pip install --no-deps --no-build-isolation --no-index -q -e . >"$tmp/pip.log" 2>&1 && resolves_here; then
    how="pip install --no-deps --no-build-isolation --no-index -e ."
else
    # A symlink tree: <tmp>/site/dispatch_amp holds links to src/dispatch_amp's entries,
    # and kernels -> the top-level kernels/ (what pyproject.toml's package-dir says).
    site=$tmp/site
    mkdir -p "$site/dispatch_amp"
    for entry in "$repo"/src/dispatch_amp/*; do
        ln -s "$entry" "$site/dispatch_amp/$(basename "$entry")"
    done
    ln -sfn "$repo/kernels" "$site/dispatch_amp/kernels"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    if resolves_here; then
        how="symlink tree on PYTHONPATH (pip -e did not work: $(tail -n 1 "$tmp/pip.log" 2>/dev/null | cut -c1-160))"
    else
        note "gpu_check.sh: cannot import dispatch_amp from $repo (neither pip -e nor a symlink tree worked):"
        tail -n 20 "$tmp/pip.log" >&2
        exit 2
    fi
fi
# The benchmarks run as `python -m benchmarks` from the repository root (their children too).
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# -- environment ------------------------------------------------------------------------------
say "# dispatch-amp GPU check"
say ""
say "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
say "- commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" status --porcelain 2>/dev/null | grep -q . && echo ' (with local changes)')"
if command -v nvidia-smi >/dev/null 2>&1; then
    while IFS= read -r line; do say "- GPU (nvidia-smi): $line"; done < <(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
fi
"$py" - <<'PY' | tee -a "$report"
import platform, torch
p = torch.cuda.get_device_properties(0)
print(f"- GPU (torch): {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
      f"compute capability {p.major}.{p.minor}")
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
try:
    import triton
    print(f"- triton {triton.__version__}")
except ImportError:
    print("- triton: not installed")
print(f"- python {platform.python_version()} ({platform.machine()})")
PY
say "- dispatch_amp: $how"

# One line for each thing skipped because a package is missing.
missing() { ! "$py" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null; }
skips=()
ignore=()
run_tests=$tests
if [ "$tests" = 1 ]; then
    for pkg in pytest hypothesis; do
        if missing "$pkg"; then
            skips+=("skipped: the CUDA test lane ($pkg is not installed; pytest and tests/conftest.py need it)")
            run_tests=0
        fi
    done
    if [ "$run_tests" = 1 ]; then
        # Test files that import a missing optional package at module level are left out.
        for pkg in expecttest numpy matplotlib transformers accelerate lightning torchao torchvision; do
            missing "$pkg" || continue
            while IFS= read -r f; do
                [ -n "$f" ] || continue
                ignore+=("--ignore=$f")
                skips+=("skipped: $f ($pkg is not installed)")
            done < <(grep -lE "^(import|from) $pkg([ .]|$)" tests/cuda/*.py 2>/dev/null)
        done
    fi
fi
if missing triton; then
    skips+=("skipped: the Triton kernels (triton is not installed): torch's fallbacks run instead, the kernels benchmark says so")
fi
if [ "$bench" = 1 ] && missing torchao; then
    skips+=("skipped: the fp8 suite's torchao comparison (torchao is not installed)")
fi
say ""
for line in ${skips[@]+"${skips[@]}"}; do say "- $line"; done
say ""

status=0

# -- the CUDA test lane -------------------------------------------------------------------------
if [ "$tests" = 1 ]; then
    say "## CUDA tests (tests/cuda)"
    say ""
    if [ "$run_tests" = 1 ]; then
        note "== python -m pytest tests/cuda (log: $pytest_log)"
        start=$(date +%s)
        # shellcheck disable=SC2086
        with_timeout "${TEST_TIMEOUT:-1500}" "$py" -m pytest tests/cuda -rA -p no:cacheprovider --junitxml="$junit" \
            ${ignore[@]+"${ignore[@]}"} ${PYTEST_ARGS:-} >"$pytest_log" 2>&1
        rc=$?
        secs=$(( $(date +%s) - start ))
        summary=$(tail -n 1 "$pytest_log")
        case $rc in
            0) verdict="passed" ;;
            5) verdict="no tests collected in tests/cuda" ;;
            124) verdict="TIMED OUT after ${TEST_TIMEOUT:-1500} s"; status=1 ;;
            *) verdict="FAILED (pytest exit status $rc)"; status=1 ;;
        esac
        say "pytest: $verdict in ${secs} s: $summary"
        say ""
        say '```'
        # The short summary (-rA: one line per test) without its PASSED lines (they stay in
        # the log), then, if any failed, the failures.
        sed -n '/short test summary info/,$p' "$pytest_log" | grep -v '^PASSED ' >>"$report"
        say '```'
        if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
            say ""
            say "<details><summary>failures (first 400 lines; whole log: $(basename "$pytest_log"))</summary>"
            say ""
            say '```'
            sed -n '/= FAILURES =\|= ERRORS =/,/short test summary info/p' "$pytest_log" | head -n 400 >>"$report"
            say '```'
            say "</details>"
        fi
        note "pytest: $verdict: $summary"
    else
        say "not run (see the skipped lines above)"
    fi
    say ""
fi

# -- the benchmarks on the GPU -------------------------------------------------------------------
if [ "$bench" = 1 ]; then
    args=(--device cuda)
    [ "$quick" = 1 ] && args+=(--quick)
    csv=$tmp/bench_csv
    say "## Benchmarks: python -m benchmarks ${args[*]}"
    say ""
    note "== python -m benchmarks ${args[*]} (stderr: $bench_err)"
    # stdout (the tables, each printed when measured) goes straight into the report.
    PYTHONUNBUFFERED=1 with_timeout "${BENCH_TIMEOUT:-900}" "$py" -m benchmarks "${args[@]}" --out "$csv" \
        2> >(tee "$bench_err" >&2) | tee -a "$report"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) ;;
        124) say ""; say "benchmarks: TIMED OUT after ${BENCH_TIMEOUT:-900} s (the tables above are those finished)"; status=1 ;;
        *) say ""; say "benchmarks: FAILED (exit status $rc; see $(basename "$bench_err"))"; status=1 ;;
    esac
    if [ -d "$csv" ]; then
        if [ -n "${OUT:-}" ]; then  # few files come back from OUT: one archive
            tar -czf "$stem.bench_csv.tar.gz" -C "$tmp" bench_csv
        else
            rm -rf "$stem.bench_csv" && cp -r "$csv" "$stem.bench_csv"
        fi
    fi
fi

say ""
say "gpu_check.sh: exit status $status"
note "report: $report"
exit "$status"
