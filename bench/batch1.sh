#!/usr/bin/env bash
# bench/batch1.sh: decode at batch 1, caraserve against llama.cpp, in tight alternation: each
# repetition runs `caraserve batch` in each of VARIANTS (no-mmap: the weights in 2 MiB pages;
# mmap: in the file's mapping; compress: --no-mmap --compress-weights, the BF16 weights coded
# losslessly in 12 bits for the GEMV; compress-only: --no-mmap --compress-weights-only, the
# code kept alone) and llama.cpp's llama-bench tg (F16 GGUF of the same
# checkpoint, its default mmap), in an order that rotates every repetition, so a minute of
# the VM's bandwidth swings hits all of them. Ratios are per repetition, then the median. The
# ~200M Llama of bench/forward.sh; decode of GEN tokens after a 16-token prompt (llama-bench:
# GEN tokens from an empty context). Each variant's resident memory at the end (and its peak)
# is recorded too. The JSON lands in bench/results/ with the CPU, its ISA features and the
# kernel path.
#
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/batch1.sh
# Env: BUILD (build), THREADS (2), GEN (128), REPS (10), PRECISION (exact), LLAMA_PY,
# VARIANTS ("no-mmap mmap compress"), BATCH (1: with more, that many sequences decode together
# and llama.cpp is left out, its llama-bench tg being one sequence)
# From a llama.cpp you built yourself, LLAMA_CPP_DIR needs: build/bin/llama-bench,
# convert_hf_to_gguf.py and gguf-py/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-128} REPS=${REPS:-10} PRECISION=${PRECISION:-exact} VARIANTS=${VARIANTS:-no-mmap mmap compress}
BATCH=${BATCH:-1}
[ -n "${LLAMA_CPP_DIR:-}" ] || [ "$BATCH" -gt 1 ] || { echo "bench/batch1.sh: set LLAMA_CPP_DIR to a llama.cpp build" >&2; exit 2; }
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -c "
import json, random
random.seed(3)
for _ in range($BATCH):
    print(json.dumps({'prompt_ids': [random.randrange(3, 32000) for _ in range(16)], 'max_tokens': $GEN, 'ignore_eos': True, 'temperature': 0}))" > "$work/req.jsonl"
results="$work/runs.jsonl"
: > "$results"
run() { # rep what
    case $2 in
    llama.cpp)
        js=$("$LLAMA_CPP_DIR/build/bin/llama-bench" -m "$gguf" -p 0 -n "$GEN" -t "$THREADS" -r 1 -o json 2>/dev/null \
            | $PY -c "import sys,json; print(json.dumps(json.load(sys.stdin)))")
        echo "{\"rep\": $1, \"what\": \"llama.cpp\", \"out\": $js}" >> "$results" ;;
    *)
        flags=(--"$2")
        [ "$2" = compress ] && flags=(--no-mmap --compress-weights)
        [ "$2" = compress-only ] && flags=(--no-mmap --compress-weights-only)
        st=$(batch_stats "$BUILD/caraserve" --model "$model" --requests "$work/req.jsonl" "${flags[@]}" \
            --precision "$PRECISION")
        echo "{\"rep\": $1, \"what\": \"$2\", \"stats\": $st}" >> "$results" ;;
    esac
}
if [ "$BATCH" -gt 1 ]; then read -r -a order <<< "$VARIANTS"; else read -r -a order <<< "$VARIANTS llama.cpp"; fi
nv=${#order[@]}
for r in $(seq "$REPS"); do
    for i in $(seq 0 $((nv - 1))); do run "$r" "${order[$(((i + r) % nv))]}"; done
    echo "rep $r done" >&2
done

out="bench/results/batch1-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$THREADS" "$GEN" "$PRECISION" "$BATCH" <<'PYEOF'
import json, statistics, sys
runs_path, out, threads, gen, precision, batch = sys.argv[1:7]
runs = [json.loads(l) for l in open(runs_path)]
med = statistics.median
tok_s = {}
for r in runs:
    if r["what"] == "llama.cpp":
        v = next(x["avg_ts"] for x in r["out"] if x["n_gen"] > 0 and x["n_prompt"] == 0)
    else:
        s = r["stats"]
        v = s["decode_only_tokens"] / s["decode_only_ms"] * 1e3
    tok_s.setdefault(r["what"], {})[r["rep"]] = v
kernels = {r["what"]: r["stats"]["backend"]["kernels"] for r in runs if "stats" in r}
weights = {r["what"]: r["stats"]["weights"] for r in runs if "stats" in r}
rss = {}
for r in runs:
    if "stats" in r and r["stats"].get("rss_bytes"):
        rss.setdefault(r["what"], []).append((r["stats"]["rss_bytes"], r["stats"]["peak_rss_bytes"]))
res = {"benchmark": "batch1", "model": "llama ~200M (1024 hidden, 12 layers, 16 heads), BF16; llama.cpp: F16 GGUF",
       "threads": int(threads), "gen_tokens": int(gen), "batch": int(batch), "precision": precision, "kernel_path": kernels,
       "weights": weights,
       "rss_mib": {k: {"median": med(a for a, _ in v) / 2**20, "peak_median": med(b for _, b in v) / 2**20}
                   for k, v in rss.items()},
       "tok_s": {k: {"runs": list(v.values()), "median": med(v.values())} for k, v in tok_s.items()}}
def paired(a, b):
    x = [tok_s[a][k] / tok_s[b][k] for k in sorted(tok_s[a]) if k in tok_s[b]]
    return {"runs": x, "median": med(x), "reps_above_1": sum(y > 1 for y in x)}
pairs = [(a, "llama.cpp") for a in tok_s if a != "llama.cpp" and "llama.cpp" in tok_s]
pairs += [(a, b) for a, b in (("no-mmap", "mmap"), ("compress", "no-mmap"), ("compress-only", "no-mmap"),
                               ("compress-only", "compress")) if a in tok_s and b in tok_s]
for a, b in pairs:
    res[f"{a}_vs_{b}".replace("-", "_").replace(".", "_")] = paired(a, b)
json.dump(res, open(out, "w"), indent=2)
print(f"kernels {kernels}, precision {precision}")
for k, v in res["tok_s"].items():
    m = res["rss_mib"].get(k)
    print(f"{k}: median {v['median']:.1f} tok/s" + (f", resident {m['median']:.0f} MiB (peak {m['peak_median']:.0f})" if m else ""))
for a, b in pairs:
    k = f"{a}_vs_{b}".replace("-", "_").replace(".", "_")
    v = res[k]
    print(f"{k}: median {v['median']:.3f} ({v['reps_above_1']} of {len(v['runs'])} above 1: "
          f"{', '.join(f'{y:.2f}' for y in v['runs'])})")
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
