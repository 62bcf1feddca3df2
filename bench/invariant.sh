#!/usr/bin/env bash
# bench/invariant.sh: what --batch-invariant costs, side by side in one run. On the ~200M
# Llama of bench/common.sh (BF16 and F32 weights, 2 threads) `caraserve batch` runs
#   - prefill: one PROMPT-token prompt (tokens/s over the busy time);
#   - decode: 32 sequences of 16-token prompts, GEN tokens each (tokens/s of the decode-only
#     iterations);
# with the default kernels and with --batch-invariant, alternating within each repetition so
# machine noise hits both alike. The JSON (medians and invariant/default ratios) lands in
# bench/results/.
#
#   bench/invariant.sh
# Env: BUILD (build), THREADS (2), GEN (32), PROMPT (512), REPS (2), CACHE
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-32} PROMPT=${PROMPT:-512} REPS=${REPS:-2}
models=()
for dt in bf16 f32; do
    DTYPE=$dt . bench/common.sh
    models+=("$model")
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY - "$work" "$PROMPT" "$GEN" <<'PYEOF'
import json, random, sys
work, prompt, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(1)
with open(f"{work}/prefill.jsonl", "w") as f:
    print(json.dumps({"prompt_ids": [random.randrange(3, 32000) for _ in range(prompt)], "max_tokens": 1}), file=f)
with open(f"{work}/decode.jsonl", "w") as f:
    for _ in range(32):
        print(json.dumps({"prompt_ids": [random.randrange(3, 32000) for _ in range(16)], "max_tokens": gen,
                          "ignore_eos": True, "temperature": 0}), file=f)
PYEOF
runs="$work/runs.jsonl"
: > "$runs"
for r in $(seq "$REPS"); do
    for m in "${models[@]}"; do
        for kind in prefill decode; do
            for mode in default invariant; do
                flag=()
                [ "$mode" = invariant ] && flag=(--batch-invariant)
                st=$(batch_stats "$BUILD/caraserve" --model "$m" --requests "$work/$kind.jsonl" \
                    --max-num-batched-tokens "$PROMPT" --max-num-seqs 64 --kv-cache-bytes 1G "${flag[@]}")
                echo "{\"rep\": $r, \"model\": \"$(basename "$m")\", \"kind\": \"$kind\", \"mode\": \"$mode\", \"stats\": $st}" >> "$runs"
                echo "rep $r $(basename "$m") $kind $mode" >&2
            done
        done
    done
done
out="bench/results/invariant-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$runs" "$out" "$THREADS" "$PROMPT" "$GEN" <<'PYEOF'
import json, statistics, sys
runs_path, out, threads, prompt, gen = sys.argv[1:6]
runs = [json.loads(l) for l in open(runs_path)]
def rate(r):
    s = r["stats"]
    if r["kind"] == "prefill":
        return s["prefill_tokens"] / s["busy_ms"] * 1e3
    return s["decode_only_tokens"] / s["decode_only_ms"] * 1e3
vals = {}
for r in runs:
    vals.setdefault((r["model"], r["kind"], r["mode"]), []).append(rate(r))
res = {"benchmark": "batch-invariant kernels vs default", "threads": int(threads), "prompt": int(prompt),
       "decode_batch": 32, "gen_tokens": int(gen),
       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
       "tok_s": {}, "invariant_over_default": {}}
for (m, k, mode), v in sorted(vals.items()):
    res["tok_s"][f"{m} {k} {mode}"] = {"runs": v, "median": statistics.median(v)}
for (m, k, mode), v in sorted(vals.items()):
    if mode == "invariant":
        ratio = statistics.median(v) / statistics.median(vals[(m, k, "default")])
        res["invariant_over_default"][f"{m} {k}"] = ratio
        print(f"{m} {k}: default {statistics.median(vals[(m, k, 'default')]):.1f} tok/s, invariant "
              f"{statistics.median(v):.1f} tok/s ({ratio:.2f}x)")
json.dump(res, open(out, "w"), indent=2)
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
