#!/usr/bin/env bash
# The GPU check: one command for a short window on a CUDA machine with no network. It runs
# its parts in this order, each under its own time budget (`timeout`), so that a slow part
# cannot starve the others, and the whole within a total budget:
#
#   train    ours/native training steps, GPT-2 small and ResNet-50, eager and compiled;
#            gradient accumulation, eval loop, the fp16-over-fp32 headline; GPT-2
#            medium eager (GPU-bound); the eager step on the Python engine and
#            with batched weight casts (a process each); each sample several steps, both ratio
#            estimators with bootstrap 95% intervals                          (200 s)
#   profile  torch.profiler summaries, ours against native, and Dynamo's logs  (70 s)
#   fp8      the fp8 suite with kernel tables, DelayedScaling's first calls,
#            torchao side by side                                               (150 s)
#   scaler   Triton unscale against a copy and torch's op; step + update; syncs (30 s)
#   tests    the CUDA test lane (tests/cuda), the bfloat16 cuDNN RNN cases first (110 s)
#
#   scripts/gpu_check.sh [--part NAME[=SECONDS] ...] [--budget SECONDS] [--steps-per-sample N]
#                        [--dry-run] [--quick]
#
#   --part NAME   run only this part (repeatable; default: all, in the order above);
#                 NAME=SECONDS also sets its budget
#   --budget S    the total budget in seconds (default 560: the check ends within one
#                 10-minute call of the GPU machine, with time for its own setup);
#                 each part gets the lesser of its own budget and what is left of the total
#   --steps-per-sample N
#                 training steps per timed sample in the train part (default 5; 2 with
#                 --dry-run or --quick): one synchronized step is too noisy a sample
#   --dry-run     on CPU, at tiny sizes, no GPU needed: every part's code runs (the CUDA-only
#                 pieces replaced by their CPU equivalents or marked n/a); the tests part only
#                 collects the lane. Budgets become hang guards (300 s a part, 900 s in all)
#   --quick       tiny sizes on the GPU: a smoke test of the GPU paths
#
# Without --dry-run it refuses (exit status 2) where torch sees no CUDA GPU.
#
# Installs nothing from the network. Wheels found in .whl/ (scripts/fetch_gpu_wheels.sh puts
# torchao there; the folder is git-ignored, so a copy of the working tree must carry it) are
# installed into a temporary folder on PYTHONPATH. It uses the python that holds torch
# (PYTHON, else the first of python3, python, .venv/bin/python that imports torch), and makes
# this checkout importable as dispatch_amp: as it already is, else `pip install --no-deps
# --no-build-isolation --no-index -e .`, else a symlink tree on PYTHONPATH.
#
# Output: $OUT/gpu_report.md when OUT is set (gpu_report.2.md, .3.md... when an earlier call
# left one there; else ${REPORT:-gpu_report.md}), dated, with the
# GPU, driver, torch, CUDA, Triton and commit; each part's tables as they are measured, then
# a summary of the parts and every target with its value. Beside it the CSV files (every row
# of every table; PART.targets.csv) and the logs (each part's stderr, pytest's log and junit
# XML, the profiles' full tables, Dynamo's logs): under OUT as gpu_report.csv.tar.gz and
# gpu_report.logs.tar.gz (few files come back from OUT), else as folders beside the report.
# Environment: PYTEST_ARGS (extra pytest arguments for the tests part).
#
# Exit status: 0 every part ran and passed; 1 a part failed, timed out or was left out for
# lack of budget (the report says which; the others still ran); 2 a usage error, no torch,
# or no CUDA GPU without --dry-run.
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die_usage() { echo "gpu_check.sh: $*" >&2; usage >&2; exit 2; }

ORDER=(train profile fp8 scaler tests)
# Sized from the H100 runs of 2026-11-26, where 345 s in all cut every part short
# (train's eager section alone took 46-61 s, its compiled section and the fp8 GPT did not
# finish): docs/performance.md, "The GPU check".
declare -A BUDGET=([train]=200 [profile]=70 [fp8]=150 [scaler]=30 [tests]=110)
declare -A ASKED_BUDGET=()
total=560
dry_run=0 quick=0 steps_per_sample=""
selected=()
is_part() { local p; for p in "${ORDER[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
is_seconds() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

while [ $# -gt 0 ]; do
    case $1 in
        --part|--part=*)
            if [ "$1" = --part ]; then
                [ $# -ge 2 ] || die_usage "--part needs a NAME (one of: ${ORDER[*]})"
                spec=$2; shift
            else
                spec=${1#--part=}
            fi
            name=${spec%%=*}
            is_part "$name" || die_usage "unknown part '$name' (the parts: ${ORDER[*]})"
            if [ "$spec" != "$name" ]; then
                is_seconds "${spec#*=}" || die_usage "--part $spec: the budget must be a whole number of seconds"
                ASKED_BUDGET[$name]=${spec#*=}
            fi
            selected+=("$name") ;;
        --budget)
            [ $# -ge 2 ] && is_seconds "$2" || die_usage "--budget needs a whole number of seconds"
            total=$2; asked_total=1; shift ;;
        --steps-per-sample)
            [ $# -ge 2 ] && is_seconds "$2" || die_usage "--steps-per-sample needs a whole number of steps, at least 1"
            steps_per_sample=$2; shift ;;
        --dry-run) dry_run=1 ;;
        --quick) quick=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die_usage "unknown option '$1'" ;;
    esac
    shift
done
if [ "$dry_run" = 1 ]; then  # hang guards: a loaded CI machine may be many times slower
    for p in "${ORDER[@]}"; do BUDGET[$p]=300; done
    [ -n "${asked_total:-}" ] || total=900
fi
for p in "${!ASKED_BUDGET[@]}"; do BUDGET[$p]=${ASKED_BUDGET[$p]}; done
parts=()
for p in "${ORDER[@]}"; do  # the order above, whatever the order of --part
    if [ ${#selected[@]} = 0 ] || [[ " ${selected[*]} " == *" $p "* ]]; then parts+=("$p"); fi
done

command -v timeout >/dev/null 2>&1 || { echo "gpu_check.sh: needs coreutils' timeout (it enforces the budgets)" >&2; exit 2; }

started=$SECONDS
invoked_from=$(pwd)
py=${PYTHON:-}
case $py in  # a relative path (not a bare command name) is relative to where the script was run
    /*|"") ;;
    */*) py=$invoked_from/$py ;;
esac
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd -P)

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
if [ "$dry_run" = 0 ] && ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    build=$("$py" -c 'import torch; print(torch.__version__, "(CUDA " + torch.version.cuda + " build)" if torch.version.cuda else "(a CPU-only build)")' 2>/dev/null)
    echo "gpu_check.sh: no CUDA GPU is visible to torch here (torch $build): this script is for GPU machines." >&2
    echo "  Rehearse it on CPU with: scripts/gpu_check.sh --dry-run" >&2
    exit 2
fi

# -- where the report goes ------------------------------------------------------------------
tmp=$(mktemp -d -t gpu-check-XXXXXX) || exit 2
trap 'rm -rf "$tmp"' EXIT
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    # Calls of this script in one device command share OUT: a later one writes beside the
    # earlier ones (gpu_report.2.md, ...) instead of over them.
    report=$OUT/gpu_report.md
    n=1
    while [ -e "$report" ]; do n=$(( n + 1 )); report=$OUT/gpu_report.$n.md; done
else
    report=${REPORT:-gpu_report.md}
    case $report in /*) ;; *) report=$invoked_from/$report ;; esac  # relative to where it was run
    mkdir -p "$(dirname "$report")"
fi
stem=${report%.md}
csv=$tmp/csv
logs=$tmp/logs
mkdir -p "$csv" "$logs"
: >"$report"
say() { printf '%s\n' "$*" | tee -a "$report"; }
note() { printf '%s\n' "$*" >&2; }

# -- wheels brought along (.whl/), into a temporary folder on PYTHONPATH ----------------------
wheels_line="none in .whl/"
shopt -s nullglob
whl=("$repo"/.whl/*.whl)
shopt -u nullglob
if [ ${#whl[@]} -gt 0 ]; then
    names=$(for w in "${whl[@]}"; do basename "$w"; done | paste -sd ' ' -)
    if "$py" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/wheels" "${whl[@]}" >"$logs/wheels.log" 2>&1; then
        export PYTHONPATH="$tmp/wheels${PYTHONPATH:+:$PYTHONPATH}"
        wheels_line="installed from .whl/ into a temporary folder on PYTHONPATH: $names"
    else
        wheels_line="FAILED to install $names (see logs/wheels.log): $(tail -n 1 "$logs/wheels.log" | cut -c1-160)"
    fi
fi

# -- dispatch_amp importable from this checkout ----------------------------------------------
# Prints nothing; exit 1 unless dispatch_amp and dispatch_amp.kernels are this checkout's
# src/dispatch_amp and src/dispatch_amp/kernels.
resolves_here() {
    (cd "$tmp" && "$py" - "$repo" <<'PY'
import os, sys
repo = sys.argv[1]
try:
    import dispatch_amp, dispatch_amp.kernels
except Exception:
    sys.exit(1)
want = {os.path.join(repo, "src", "dispatch_amp"), os.path.join(repo, "src", "dispatch_amp", "kernels")}
got = {os.path.dirname(os.path.realpath(m.__file__)) for m in (dispatch_amp, dispatch_amp.kernels)}
sys.exit(0 if got == want else 1)
PY
    ) >/dev/null 2>&1
}

how=""
if resolves_here; then
    how="already importable from this checkout"
elif "$py" -m pip install --no-deps --no-build-isolation --no-index -q -e . >"$logs/pip-e.log" 2>&1 && resolves_here; then
    how="pip install --no-deps --no-build-isolation --no-index -e ."
else
    # A symlink tree: <tmp>/site/dispatch_amp holds links to src/dispatch_amp's entries
    # (its kernels subpackage among them).
    site=$tmp/site
    mkdir -p "$site/dispatch_amp"
    for entry in "$repo"/src/dispatch_amp/*; do
        ln -s "$entry" "$site/dispatch_amp/$(basename "$entry")"
    done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    if resolves_here; then
        how="symlink tree on PYTHONPATH (pip -e did not work: $(tail -n 1 "$logs/pip-e.log" 2>/dev/null | cut -c1-160))"
    else
        note "gpu_check.sh: cannot import dispatch_amp from $repo (neither pip -e nor a symlink tree worked):"
        tail -n 20 "$logs/pip-e.log" >&2
        exit 2
    fi
fi
# The parts run as `python -m benchmarks.check` from the repository root.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

missing() { ! "$py" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null; }

# -- the report's head ------------------------------------------------------------------------
mode="the full check"
[ "$quick" = 1 ] && mode="--quick: tiny sizes on the GPU, a smoke test"
[ "$dry_run" = 1 ] && mode="--dry-run: on CPU at tiny sizes, a rehearsal of the code (no number here is a measurement)"
say "# dispatch-amp GPU check"
say ""
"$py" -m benchmarks.check environment 2>"$logs/environment.log" | tee -a "$report"
say "- dispatch_amp: $how"
say "- wheels: $wheels_line"
missing torchao && say "- torchao: not installed, so the fp8 part's torchao comparison is skipped (scripts/fetch_gpu_wheels.sh downloads a wheel into .whl/, which the copy of the tree must carry)"
missing triton && say "- triton: not installed, so torch's fallbacks run where the Triton kernels would"
say "- mode: $mode"
say "- train steps per timed sample: ${steps_per_sample:-the default ($([ "$dry_run$quick" = 00 ] && echo 5 || echo 2))}; ratios by both estimators (median of per-round ratios, ratio of medians), each with a bootstrap 95% interval"
budgets=$(for p in "${parts[@]}"; do printf '%s %ss, ' "$p" "${BUDGET[$p]}"; done)
say "- parts and budgets: ${budgets%, } (total $total s)"
say ""

declare -A STATUS=() TOOK=()
status=0
flags=()
[ "$dry_run" = 1 ] && flags+=(--dry-run)
[ "$quick" = 1 ] && flags+=(--quick)
[ -n "$steps_per_sample" ] && flags+=(--steps-per-sample "$steps_per_sample")

# Seconds part $1 may run: its budget, at most what is left of the total (0: none left).
allowance() {
    local left=$(( total - (SECONDS - started) ))
    local b=${BUDGET[$1]}
    if [ "$left" -lt "$b" ]; then
        b=$left
        [ "$b" -lt 10 ] && b=0  # too little of the total left to start a part
    fi
    echo "$b"
}

# timeout sends SIGINT first: Python parts write what they finished, pytest prints its summary.
with_timeout() {
    local secs=$1
    shift
    timeout -s INT -k 10 "$secs" "$@"
}

verdict_of() {  # exit status, budget -> the part's status
    case $1 in
        0) echo "passed" ;;
        124|130) echo "TIMED OUT after $2 s" ;;
        *) echo "FAILED (exit status $1)" ;;
    esac
}

run_python_part() {  # name, seconds
    local name=$1 secs=$2 rc
    with_timeout "$secs" "$py" -m benchmarks.check "$name" --out "$csv" --logs "$logs" ${flags[@]+"${flags[@]}"} \
        2>"$logs/$name.stderr.log" | tee -a "$report"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) ;;
        124|130) say ""; say "$name: TIMED OUT after $secs s (the tables above are those finished)" ;;
        *) say ""; say "$name: FAILED (exit status $rc); the last lines of its stderr (logs/$name.stderr.log):"
           say '```'; grep -v '^USDT' "$logs/$name.stderr.log" | tail -n 15 >>"$report"; say '```' ;;
    esac
    return "$rc"
}

# The cuDNN RNN cases under bfloat16: the RNN layers (lstm/gru/rnn_tanh taggers) and, on CUDA
# builds, the _cudnn_rnn registration itself.
RNN_CASES="(tagger or _cudnn_rnn) and bfloat16"

pytest_run() {  # label, seconds, -k expression
    local label=$1 secs=$2 expr=$3 log=$logs/pytest.$1.log rc t0=$SECONDS summary
    note "== pytest tests/cuda -k '$expr' (log: logs/pytest.$label.log)"
    # shellcheck disable=SC2086
    with_timeout "$secs" "$py" -m pytest tests/cuda -k "$expr" -rA -p no:cacheprovider \
        --junitxml="$logs/pytest.$label.junit.xml" ${PYTEST_ARGS:-} >"$log" 2>&1
    rc=$?
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$log" | tail -n 1)
    [ -n "$summary" ] || summary=$(tail -n 1 "$log")
    case $rc in
        0) v="passed" ;;
        5) v="no tests collected" ;;
        124|130) v="TIMED OUT after $secs s" ;;
        *) v="FAILED (pytest exit status $rc)" ;;
    esac
    say "pytest ($label: -k \"$expr\"): $v in $(( SECONDS - t0 )) s: $summary"
    tests_verdict+="${tests_verdict:+; }$label: $v"
    say ""
    if grep -q 'short test summary info' "$log"; then
        say '```'
        # the short summary, up to its closing count line, without its PASSED lines (they stay in the log)
        awk '/short test summary info/ { on = 1 } on && !/^PASSED / { print }
             on && /^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)/ { exit }' \
            "$log" >>"$report"
        say '```'
    fi
    if grep -qE '^=+ (FAILURES|ERRORS) =+$' "$log"; then
        say ""
        say "<details><summary>failures, first 300 lines (whole log: logs/pytest.$label.log)</summary>"
        say ""
        say '```'
        sed -n '/= FAILURES =\|= ERRORS =/,/short test summary info/p' "$log" | head -n 300 >>"$report"
        say '```'
        say "</details>"
    fi
    say ""
    [ "$rc" = 0 ]
}

run_tests_part() {  # seconds
    local secs=$1 rc=0 t0=$SECONDS collected rnn left pkg
    for pkg in pytest hypothesis; do
        if missing "$pkg"; then
            say "not run: $pkg is not installed (pytest and tests/conftest.py need it)"
            tests_verdict="NOT RUN ($pkg is not installed)"
            return 1
        fi
    done
    if [ "$dry_run" = 1 ]; then
        # One collection with the GPU run's first selection: "N/M tests collected (K deselected)".
        # (pyproject's addopts has -q: one node id a line.)
        with_timeout "$secs" "$py" -m pytest tests/cuda --collect-only -p no:cacheprovider -k "$RNN_CASES" \
            >"$logs/pytest.collect.log" 2>&1
        rc=$?
        collected=$(grep -oE '[0-9]+/[0-9]+ tests? collected' "$logs/pytest.collect.log" | tail -n 1)
        rnn=$(grep '::' "$logs/pytest.collect.log")
        say "not run: no GPU (a dry run). pytest tests/cuda --collect-only (exit status $rc): ${collected:-nothing collected};"
        say "the selected ones are the bfloat16 cuDNN RNN cases, which the GPU run takes first (-k \"$RNN_CASES\"):"
        say ""
        say '```'
        say "${rnn:-NONE COLLECTED}"
        say '```'
        if [ "$rc" = 0 ] && [ -n "$collected" ] && [ -n "$rnn" ]; then
            tests_verdict="collected (dry run)"
            return 0
        fi
        tests_verdict="FAILED to collect the lane or its cuDNN RNN cases"
        return 1
    fi
    pytest_run rnn "$secs" "$RNN_CASES" || rc=1
    left=$(( secs - (SECONDS - t0) ))
    if [ "$left" -lt 10 ]; then
        say "the rest of the lane: not run (its budget is spent)"
        tests_verdict+="; rest: NOT RUN (no budget left)"
        return 1
    fi
    pytest_run rest "$left" "not ($RNN_CASES)" || rc=1
    return "$rc"
}

for part in "${parts[@]}"; do
    secs=$(allowance "$part")
    say "## Part: $part"
    say ""
    if [ "$secs" = 0 ]; then
        say "not run: the total budget of $total s is spent"
        say ""
        STATUS[$part]="NOT RUN (no budget left)"; TOOK[$part]=0; status=1
        continue
    fi
    note "== part $part (budget $secs s)"
    t0=$SECONDS
    if [ "$part" = tests ]; then
        tests_verdict=""
        run_tests_part "$secs"
        rc=$?
        v=$tests_verdict
    else
        run_python_part "$part" "$secs"
        rc=$?
        v=$(verdict_of "$rc" "$secs")
    fi
    [ "$rc" = 0 ] || status=1
    STATUS[$part]=$v; TOOK[$part]=$(( SECONDS - t0 ))
    say ""
done

# -- summary ------------------------------------------------------------------------------------
say "## Summary"
say ""
summary() {  # tab-separated rows, printed by the package's Markdown table helper (standard library only)
    printf 'part\tstatus\tseconds\tbudget\n'
    for part in "${parts[@]}"; do printf '%s\t%s\t%s\t%s\n' "$part" "${STATUS[$part]}" "${TOOK[$part]}" "${BUDGET[$part]}"; done
}
say "$(summary | "$py" "$repo/src/dispatch_amp/_markdown.py" --align llrr)"
say ""
say "whole check: $(( SECONDS - started )) s (total budget $total s)"
say ""
"$py" -m benchmarks.check targets "$csv" "${parts[@]}" 2>>"$logs/targets.log" | tee -a "$report"
say ""

# -- CSV files and logs beside the report ---------------------------------------------------------
if [ -n "${OUT:-}" ]; then  # few files come back from OUT: two archives
    tar -czf "$stem.csv.tar.gz" -C "$tmp" csv
    tar -czf "$stem.logs.tar.gz" -C "$tmp" logs
    for f in "$stem.csv.tar.gz" "$stem.logs.tar.gz"; do
        size=$(wc -c <"$f")
        [ "$size" -le $(( 15 * 1024 * 1024 )) ] || say "- $(basename "$f") is $size bytes, over what comes back from OUT (16 MiB a file)"
    done
    say "files: $(basename "$report"), $(basename "$stem").csv.tar.gz (every table's rows), $(basename "$stem").logs.tar.gz (logs)"
else
    rm -rf "$stem.csv" "$stem.logs" && cp -r "$csv" "$stem.csv" && cp -r "$logs" "$stem.logs"
    say "files: $(basename "$report"), $(basename "$stem").csv/ (every table's rows), $(basename "$stem").logs/ (logs)"
fi
say "gpu_check.sh: exit status $status"
note "report: $report"
exit "$status"
