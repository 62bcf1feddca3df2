#!/usr/bin/env bash
# bench/ab.sh: this build (BUILD) against another build of caraserve (BASE_BUILD: say the
# commit before a change, built in a git worktree) on the workloads of bench/forward.sh and
# bench/engine.sh, alternating the two within each repetition so machine noise hits both
# alike. Reports each figure's ratio BUILD / BASE_BUILD (medians); the JSON lands in
# bench/results/ab-<time>.json with the CPU, its ISA features and the kernel path.
#
#   git worktree add /tmp/base HEAD~1 && (cd /tmp/base && autoreconf -fi && mkdir build && cd build &&
#       ../configure && make caraserve)
#   BASE_BUILD=/tmp/base/build bench/ab.sh
# Env: BUILD (build), BASE_BUILD (required), THREADS (2), GEN (32), PROMPT (512), REPS (3), DTYPE (bf16),
#      PRECISION (exact, or bf16: both builds under --precision bf16), CACHE,
#      MEASURE (time, or instructions: each figure run once per build under valgrind's callgrind
#      with 1 thread, GEN 4 and PROMPT 64, on a small Llama of the same shape family (hidden
#      256, 4 layers, vocab 32000: a per-op overhead weighs more there than on the 200M one),
#      and the ratio taken of the instructions executed, new / base: repeatable to the
#      instruction on a machine too noisy for timings)
#
# The figures: forward = `caraserve generate` of a PROMPT-token prompt then GEN tokens (prefill
# and decode tok/s); engine = `caraserve batch` decode tok/s over its decode-only iterations
# at batch 1, 8 and 32 (16-token prompts, GEN tokens, greedy), batch 8 with 8 distinct rank-16
# adapters, and the prefill of a PROMPT-token prompt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MEASURE=${MEASURE:-time}
if [ "$MEASURE" = instructions ]; then GEN=${GEN:-4} PROMPT=${PROMPT:-64} REPS=1 THREADS=1; fi
GEN=${GEN:-32} PROMPT=${PROMPT:-512} REPS=${REPS:-3} PRECISION=${PRECISION:-exact}
[ -n "${BASE_BUILD:-}" ] || { echo "ab.sh: set BASE_BUILD to the other build directory" >&2; exit 2; }
. bench/common.sh
tag=200m
if [ "$MEASURE" = instructions ]; then
    tag=small
    model="$CACHE/llama-small-$DTYPE"
    [ -f "$model/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama --hidden 256 --layers 4 \
        --heads 8 --intermediate 688 --vocab 32000 --dtype "$DTYPE" --seed 1 --tokenizer "$CACHE/spm-32k" >&2
fi
for b in "$BUILD" "$BASE_BUILD"; do
    [ -x "$b/caraserve" ] || { echo "ab.sh: $b/caraserve not built" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bench_adapters "llama-$tag" # lora_args: --lora ad0..ad7 (bench/common.sh)
$PY - "$work" "$GEN" "$PROMPT" <<'PYEOF'
import json, random, sys
work, gen, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for b, a in ((1, 0), (8, 0), (8, 8), (32, 0)):
    random.seed(b * 100 + a)
    with open(f"{work}/req-{b}-{a}.jsonl", "w") as f:
        for i in range(b):
            r = {"prompt_ids": [random.randrange(3, 32000) for _ in range(16)], "max_tokens": gen, "ignore_eos": True,
                 "temperature": 0}
            if a:
                r["adapter"] = f"ad{i % a}"
            f.write(json.dumps(r) + "\n")
random.seed(1)
ids = [random.randrange(3, 32000) for _ in range(prompt)]
open(f"{work}/prefill.jsonl", "w").write(json.dumps({"prompt_ids": ids, "max_tokens": 1}) + "\n")
open(f"{work}/ids.txt", "w").write(",".join(map(str, ids)))
PYEOF
ids=$(cat "$work/ids.txt")
results="$work/runs.jsonl"
: > "$results"
# under callgrind: the instructions executed, from its "Collected" line
counted() { # label kind config command...
    local label=$1 kind=$2 config=$3 n err steps
    shift 3
    err=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 >/dev/null)
    n=$(printf '%s\n' "$err" | sed -n 's/.*Collected : *\([0-9]*\).*/\1/p')
    # the engine's iterations: a run whose adapter loads finished at other moments batches
    # differently, and its count is not comparable
    steps=$(printf '%s\n' "$err" | sed -n 's/^{.*"steps": *\([0-9]*\).*/\1/p')
    echo "{\"build\": \"$label\", \"kind\": \"instructions\", \"figure\": \"$kind$config\", \"n\": $n, \"steps\": ${steps:-null}}" >> "${OUT_LINES:-$results}"
}
# an engine figure: both builds, again (up to 4 times) until they ran the same iterations
pair_batch() { # config
    local c=$1 try
    for try in 1 2 3 4; do
        : > "$work/pair"
        for lb in "new $BUILD" "base $BASE_BUILD"; do
            OUT_LINES="$work/pair" counted "${lb%% *}" engine_batch "$c" "${lb#* }/caraserve" batch --model "$model" \
                "${lora_args[@]}" --requests "$work/req-${c%%:*}-${c##*:}.jsonl" --threads 1 --max-num-seqs 64 \
                --kv-cache-bytes 256M --stats
        done
        [ "$(sed -n 's/.*"steps": \([0-9]*\).*/\1/p' "$work/pair" | sort -u | wc -l)" -eq 1 ] && break
        echo "ab.sh: batch $c: the builds ran different numbers of iterations (adapter loads): again" >&2
    done
    cat "$work/pair" >> "$results"
}
one_instructions() { # label build
    local label=$1 b=$2
    counted "$label" forward "" "$b/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens "$GEN" \
        --ignore-eos --threads 1
}
one() { # label build
    local label=$1 b=$2 st
    if [ "$MEASURE" = instructions ]; then one_instructions "$label" "$b"; return; fi
    st=$("$b/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens "$GEN" --ignore-eos --stats \
        --threads "$THREADS" --precision "$PRECISION" 2>&1 >/dev/null | grep '^stats:')
    echo "{\"build\": \"$label\", \"kind\": \"forward\", \"stats\": $(printf '%s' "$st" | $PY -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" >> "$results"
    for c in 1:0 8:0 8:8 32:0; do
        st=$(batch_stats "$b/caraserve" --model "$model" "${lora_args[@]}" --requests "$work/req-${c%%:*}-${c##*:}.jsonl" \
            --precision "$PRECISION" --max-num-seqs 64 --kv-cache-bytes 1G)
        echo "{\"build\": \"$label\", \"kind\": \"decode\", \"config\": \"$c\", \"stats\": $st}" >> "$results"
    done
    st=$(batch_stats "$b/caraserve" --model "$model" --requests "$work/prefill.jsonl" --precision "$PRECISION" \
        --max-num-batched-tokens "$PROMPT")
    echo "{\"build\": \"$label\", \"kind\": \"prefill\", \"stats\": $st}" >> "$results"
}
for r in $(seq "$REPS"); do
    # alternate which goes first
    if [ $((r % 2)) -eq 1 ]; then one new "$BUILD"; one base "$BASE_BUILD"; else one base "$BASE_BUILD"; one new "$BUILD"; fi
    if [ "$MEASURE" = instructions ]; then for c in 1:0 8:0 8:8; do pair_batch "$c"; done; fi
    echo "ab.sh: repetition $r of $REPS done" >&2
done
out="bench/results/ab-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$BUILD" "$BASE_BUILD" "$THREADS" "$GEN" "$PROMPT" "$DTYPE" "$PRECISION" <<'PYEOF'
import json, re, statistics, subprocess, sys
runs_path, out, build, base, threads, gen, prompt, dtype, precision = sys.argv[1:10]
runs = [json.loads(l) for l in open(runs_path)]
fig = {}
def add(build, key, v):
    fig.setdefault(key, {}).setdefault(build, []).append(v)
kernels = None
for r in runs:
    if r["kind"] == "instructions":
        add(r["build"], "instructions_" + r["figure"], float(r["n"]))
        if r.get("steps") is not None:
            fig.setdefault("instructions_" + r["figure"], {}).setdefault("steps_" + r["build"], []).append(r["steps"])
    elif r["kind"] == "forward":
        m = re.search(r"prefill \d+ tokens in [\d.]+ ms \(([\d.]+) tok/s\) \| decode \d+ tokens in [\d.]+ ms \(([\d.]+) tok/s\)",
                      r["stats"])
        add(r["build"], "forward_prefill_tok_s", float(m.group(1)))
        add(r["build"], "forward_decode_tok_s", float(m.group(2)))
    elif r["kind"] == "decode":
        s = r["stats"]
        b, a = r["config"].split(":")
        add(r["build"], f"engine_decode_batch{b}_adapters{a}_tok_s", s["decode_only_tokens"] / s["decode_only_ms"] * 1e3)
        if r["build"] == "new" and "backend" in s:
            kernels = s["backend"]["kernels"]
    elif r["kind"] == "prefill":
        s = r["stats"]
        add(r["build"], "engine_prefill_tok_s", s["prefill_tokens"] / s["busy_ms"] * 1e3)
med = statistics.median
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
res = {"benchmark": "ab", "build": build, "base_build": base,
       "commits": {k: subprocess.run(["git", "-C", d, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
                   for k, d in (("build", "."), ("base_build", base))},
       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
       "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
       "kernel_path": kernels, "measure": "instructions (callgrind)" if any(r["kind"] == "instructions" for r in runs)
       else "wall time", "precision": precision, "threads": int(threads), "gen_tokens": int(gen), "prompt_tokens": int(prompt),
       "model": f"llama {'~200M (bench/common.sh)' if not any(r['kind'] == 'instructions' for r in runs) else 'small (hidden 256, 4 layers, vocab 32000)'}, {dtype.upper()}",
       "figures": {}}
for k, v in fig.items():
    a, b = v.get("new", []), v.get("base", [])
    res["figures"][k] = {"new": a, "base": b, "new_median": med(a), "base_median": med(b), "ratio": med(a) / med(b)}
    if len(a) == len(b) and len(a) > 1: # each repetition's pair, run back to back
        res["figures"][k]["paired_ratio_median"] = med([x / y for x, y in zip(a, b)])
    if v.get("steps_new") is not None:
        res["figures"][k]["engine_steps"] = {"new": v["steps_new"], "base": v.get("steps_base")}
        res["figures"][k]["comparable"] = v["steps_new"] == v.get("steps_base")
json.dump(res, open(out, "w"), indent=1)
print(f"{'figure':44s} {'new':>10s} {'base':>10s} {'ratio':>7s} {'paired':>7s}")
for k, v in res["figures"].items():
    note = "" if v.get("comparable", True) else f"  (not comparable: {v['engine_steps']} engine steps)"
    pr = f"{v['paired_ratio_median']:7.4f}" if "paired_ratio_median" in v else f"{'':7s}"
    print(f"{k:44s} {v['new_median']:10.5g} {v['base_median']:10.5g} {v['ratio']:7.4f} {pr}{note}")
print(f"cpu: {res['cpu']} ({', '.join(res['isa'])}), kernels {kernels}; JSON: {out}")
PYEOF
bench_stamp "$out"
