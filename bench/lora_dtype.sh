#!/usr/bin/env bash
# bench/lora_dtype.sh: what 8 distinct rank-16 adapters (all 7 projections) cost a decode
# batch of 8 on the ~200M Llama of bench/forward.sh (BF16, 2 threads), with the adapters'
# weights in F32 and in BF16, against the base model alone, side by side in one run:
#   base         the batch without adapters
#   f32, bf16    each row on its own adapter, the adapter files in that dtype
# The cost is base tok/s over adapter tok/s, minus 1. BF16 adapters stay BF16 in their
# backend slot (half the bytes per token to stream); before that, they were widened to F32.
# With BASE_BUILD=dir (a build of another commit), its caraserve runs the same three
# configurations in the same repetitions, so both commits are compared under one noise.
# Configurations alternate within each repetition; the JSON lands in bench/results/.
#
#   bench/lora_dtype.sh
#   BASE_BUILD=/tmp/base-build bench/lora_dtype.sh
# Env: BUILD (build), THREADS (2), GEN (64), REPS (5), BATCH (8), CACHE, BASE_BUILD
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-64} REPS=${REPS:-5} BATCH=${BATCH:-8}
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

args_f32=() args_bf16=()
for i in 0 1 2 3 4 5 6 7; do
    for dt in f32 bf16; do
        a="$CACHE/llama-200m-lora-r16-$i"
        [ "$dt" = bf16 ] && a="$CACHE/llama-200m-lora-r16-bf16-$i"
        [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank 16 \
            --alpha 32 --seed $((40 + i)) --dtype "$dt" >&2
        if [ "$dt" = f32 ]; then args_f32+=(--lora "ad$i=$a"); else args_bf16+=(--lora "ad$i=$a"); fi
    done
done
$PY - "$BATCH" "$GEN" > "$work/req-ad.jsonl" <<'PYEOF'
import json, random, sys
b, gen = map(int, sys.argv[1:3])
random.seed(b)
for i in range(b):
    print(json.dumps({"prompt_ids": [random.randrange(3, 32000) for _ in range(16)], "max_tokens": gen,
                      "ignore_eos": True, "temperature": 0, "adapter": f"ad{i % 8}"}))
PYEOF
sed 's/, "adapter": "ad[0-9]*"//' "$work/req-ad.jsonl" > "$work/req-base.jsonl"

builds=("new:$BUILD")
[ -n "${BASE_BUILD:-}" ] && builds+=("base:$BASE_BUILD")
results="$work/runs.jsonl"
: > "$results"
path=$(batch_stats "$BUILD/caraserve" --model "$model" --requests /dev/null \
    | $PY -c "import json,sys; s=json.load(sys.stdin); print(s.get('backend', {}).get('kernels', '?'))" || echo "?")
for r in $(seq "$REPS"); do
    for bb in "${builds[@]}"; do
        name=${bb%%:*} dir=${bb#*:}
        for cfg in base f32 bf16; do
            la=()
            req="$work/req-ad.jsonl"
            case $cfg in
            base) req="$work/req-base.jsonl" ;;
            f32) la=("${args_f32[@]}") ;;
            bf16) la=("${args_bf16[@]}") ;;
            esac
            st=$(batch_stats "$dir/caraserve" --model "$model" "${la[@]}" --requests "$req" --max-num-seqs 64 \
                --kv-cache-bytes 1G)
            echo "{\"rep\": $r, \"build\": \"$name\", \"config\": \"$cfg\", \"stats\": $st}" >> "$results"
            echo "rep $r $name $cfg: $(decode_tps "$st")" >&2
        done
    done
done

out="bench/results/lora-dtype-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$THREADS" "$GEN" "$BATCH" "$path" <<'PYEOF'
import json, statistics, sys
runs_path, out, threads, gen, batch, path = sys.argv[1:7]
runs = [json.loads(l) for l in open(runs_path)]
tps = {}
for r in runs:
    s = r["stats"]
    tps.setdefault((r["build"], r["config"]), []).append(s["decode_only_tokens"] / s["decode_only_ms"] * 1e3)
med = statistics.median
res = {"benchmark": "lora_dtype", "model": "llama ~200M (1024 hidden, 12 layers, inter 2816, vocab 32000), BF16",
       "threads": int(threads), "gen_tokens": int(gen), "batch": int(batch), "adapters": 8, "adapter_rank": 16,
       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
       "kernel_path": path,
       "decode_tok_s": {f"{b}_{c}": {"runs": v, "median": med(v)} for (b, c), v in sorted(tps.items())}}
for b in sorted({b for b, _ in tps}):
    base = med(tps[(b, "base")])
    for c in ("f32", "bf16"):
        # per repetition (the three ran back to back), then the median
        per = [x / y - 1 for x, y in zip(tps[(b, "base")], tps[(b, c)])]
        res[f"{b}_cost_{c}_adapters"] = {"per_rep": per, "median": med(per), "of_medians": base / med(tps[(b, c)]) - 1}
json.dump(res, open(out, "w"), indent=2)
for k, v in sorted(res.items()):
    if "_cost_" in k:
        print(f"{k}: +{100 * v['median']:.1f}% (median of per-repetition ratios)")
print(out)
PYEOF
bench_stamp "$out"
