#!/usr/bin/env bash
# run.sh SECONDS [TARGET...]: coverage-guided fuzzing of every target (or those named) with
# libFuzzer, SECONDS each, two at a time per CPU pair (all cores busy), under ASan + UBSan.
#
# Builds its own tree with clang (--enable-fuzzing --enable-sanitizers) in $CS_FUZZ_BUILD
# (default build-fuzz beside this checkout), seeds each target's working corpus from
# tests/fuzz/corpus/T and tests/fuzz/regressions/T, and writes a summary (executions, coverage,
# corpus, findings per target; the CPU, the compiler, the commit) to
# bench/results/fuzz-<UTC time>.json ($CS_FUZZ_RESULTS overrides the folder). A finding (crash,
# leak, timeout, out of memory) is kept under $CS_FUZZ_BUILD/fuzz-work/T/ and the exit status
# is 1: reproduce it with the make check binary, build/tests/fuzz/fuzz_T FILE, fix the bug,
# and keep the input in tests/fuzz/regressions/T.
# CS_FUZZ_RUNS=N: N inputs per target from seed 1 instead of SECONDS (the same inputs on every
# run of the same build: what CI runs, so a finding there is no accident of timing).
# Needs clang and libFuzzer (Debian: clang libclang-rt-14-dev; ./quickstart test installs them).
set -euo pipefail
secs=${1:?usage: tests/fuzz/run.sh SECONDS [TARGET...]}
shift
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${CS_FUZZ_BUILD:-$src/build-fuzz}
results=${CS_FUZZ_RESULTS:-$src/bench/results}
all="completions chat rollout safetensors model_config adapter_config tokenizer_json tokenizer chat_template config_file stream gbnf regex schema lark keys gguf gguf_tokenizer"
targets=${*:-$all}
command -v clang >/dev/null || { echo "run.sh: clang is not installed (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }

if [ ! -f "$build/Makefile" ]; then
    mkdir -p "$build"
    (cd "$build" && "$src/configure" -q CC=clang CXX=clang++ --enable-fuzzing --enable-sanitizers --without-cuda)
fi
bins=""
for t in $targets; do bins="$bins tests/fuzz/fuzz_$t"; done
make -C "$build" -s -j"$(nproc)" tests/fuzz-data.stamp $bins >/dev/null

work=$build/fuzz-work
mkdir -p "$work"
export CS_FUZZ_BUILDDIR=$build
# leaks are findings; the sanitizers stop at the first error
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

fuzz_one() {
    local t=$1 dir=$work/$1
    rm -rf "$dir/findings"
    mkdir -p "$dir/corpus" "$dir/findings"
    cp "$src/tests/fuzz/corpus/$t/"* "$dir/corpus/" 2>/dev/null || true
    local extra=()
    [ -d "$src/tests/fuzz/regressions/$t" ] && extra=("$src/tests/fuzz/regressions/$t")
    local budget=(-max_total_time="$secs")
    [ -n "${CS_FUZZ_RUNS:-}" ] && budget=(-runs="$CS_FUZZ_RUNS" -seed=1)
    "$build/tests/fuzz/fuzz_$t" "${budget[@]}" -timeout=60 -rss_limit_mb=4096 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="$dir/findings/" "$dir/corpus" "${extra[@]}" > "$dir/log" 2>&1 || true
}

jobs_max=$(nproc)
for t in $targets; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    echo "fuzzing $t for $secs s" >&2
    fuzz_one "$t" &
done
wait

stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$results"
out=$results/fuzz-$stamp.json
found=0
{
    printf '{\n  "kind": "fuzz",\n  "seconds_per_target": %s,\n  "runs_per_target": %s,\n' "$secs" "${CS_FUZZ_RUNS:-null}"
    printf '  "cpu": "%s",\n' "$(lscpu | sed -n 's/^Model name: *//p' | head -1)"
    printf '  "compiler": "%s",\n' "$(clang --version | head -1)"
    printf '  "sanitizers": "address,undefined (libFuzzer)",\n'
    printf '  "commit": "%s",\n  "targets": {\n' "$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    first=1
    for t in $targets; do
        log=$work/$t/log
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
        ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
        corpus=$(find "$work/$t/corpus" -type f | wc -l)
        # crashes, leaks, timeouts (-timeout), out of memory; slow units (over 10 s, libFuzzer's
        # -report_slow_units) are listed apart: a hint, not a failure
        n_find=$(find "$work/$t/findings" -type f ! -name 'slow-unit-*' | wc -l)
        names=$(find "$work/$t/findings" -type f ! -name 'slow-unit-*' -printf '"%f",' | sed 's/,$//')
        slow=$(find "$work/$t/findings" -type f -name 'slow-unit-*' -printf '"%f",' | sed 's/,$//')
        found=$((found + n_find))
        [ $first = 1 ] || printf ',\n'
        first=0
        printf '    "%s": {"executions": %s, "coverage_edges": %s, "features": %s, "corpus": %s, "findings": [%s], "slow_units": [%s]}' \
            "$t" "${execs:-0}" "${cov:-0}" "${ft:-0}" "$corpus" "$names" "$slow"
    done
    printf '\n  },\n  "findings_total": %s\n}\n' "$found"
} > "$out"
cat "$out"
if [ "$found" -gt 0 ]; then
    echo "run.sh: findings above; logs and inputs in $work/*/" >&2
    exit 1
fi
echo "run.sh: no findings ($out)" >&2
