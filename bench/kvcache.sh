#!/usr/bin/env bash
# bench/kvcache.sh: what a BF16 KV cache buys on the CPU backend, side by side in one run:
# decode tokens/s of `caraserve batch` with --kv-cache-dtype f32 and bf16, alternating within
# each repetition, on the ~200M Llama of bench/forward.sh (BF16 weights, 16 heads without GQA:
# 96 KiB of F32 K and V per token), at
#   - batch 1 after a 16-token and a LONG-token prompt (attention over a long context),
#   - batch 32 after 16-token and MID-token prompts (every sequence's own context).
# Each configuration's ratio bf16 / f32 is the median over the repetitions' pairs. The
# precision is PRECISION's (bf16: where auto picks the BF16 cache; exact: the opt-in). The
# JSON lands in bench/results/ with the CPU, its ISA features and the kernel path.
#
#   bench/kvcache.sh
# Env: BUILD (build), THREADS (2), GEN (64), LONG (1024), MID (256), REPS (3), PRECISION (bf16)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-64} LONG=${LONG:-1024} MID=${MID:-256} REPS=${REPS:-3} PRECISION=${PRECISION:-bf16}
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

configs="1:16 1:$LONG 32:16 32:$MID"
for c in $configs; do # B sequences with distinct P-token prompts (no prefix shared), GEN tokens each
    $PY - "${c%%:*}" "${c##*:}" "$GEN" > "$work/req-${c%%:*}-${c##*:}.jsonl" <<'PYEOF'
import json, random, sys
b, p, gen = map(int, sys.argv[1:4])
random.seed(b * 7919 + p)
for i in range(b):
    print(json.dumps({"prompt_ids": [random.randrange(3, 32000) for _ in range(p)], "max_tokens": gen,
                      "ignore_eos": True, "temperature": 0}))
PYEOF
done

results="$work/runs.jsonl"
: > "$results"
for r in $(seq "$REPS"); do
    for c in $configs; do
        b=${c%%:*} p=${c##*:}
        for kv in f32 bf16; do
            st=$(batch_stats "$BUILD/caraserve" --model "$model" --requests "$work/req-$b-$p.jsonl" --precision "$PRECISION" \
                --kv-cache-dtype "$kv" --max-num-seqs 64 --kv-cache-bytes 2G)
            echo "{\"rep\": $r, \"batch\": $b, \"prompt\": $p, \"kv\": \"$kv\", \"stats\": $st}" >> "$results"
            echo "rep $r batch $b prompt $p kv $kv: $(decode_tps "$st")" >&2
        done
    done
done

out="bench/results/kvcache-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$THREADS" "$GEN" "$PRECISION" <<'PYEOF'
import json, statistics, sys
runs_path, out, threads, gen, precision = sys.argv[1:6]
runs = [json.loads(l) for l in open(runs_path)]
med = statistics.median
tps = lambda s: s["decode_only_tokens"] / s["decode_only_ms"] * 1e3
kernels = next((r["stats"]["backend"]["kernels"] for r in runs), None)
res = {"benchmark": "kvcache", "model": "llama ~200M (1024 hidden, 12 layers, 16 heads, no GQA), BF16",
       "threads": int(threads), "gen_tokens": int(gen), "precision": precision, "kernel_path": kernels, "configs": {}}
for key in sorted({(r["batch"], r["prompt"]) for r in runs}):
    b, p = key
    f32 = {r["rep"]: tps(r["stats"]) for r in runs if (r["batch"], r["prompt"]) == key and r["kv"] == "f32"}
    bf = {r["rep"]: tps(r["stats"]) for r in runs if (r["batch"], r["prompt"]) == key and r["kv"] == "bf16"}
    assert all(r["stats"]["kv_dtype"] == r["kv"].upper() for r in runs), "a run's cache is not the dtype asked for"
    ratios = [bf[k] / f32[k] for k in sorted(f32) if k in bf]
    res["configs"][f"batch{b}_prompt{p}"] = {"f32_tok_s": {"runs": list(f32.values()), "median": med(f32.values())},
                                             "bf16_tok_s": {"runs": list(bf.values()), "median": med(bf.values())},
                                             "bf16_vs_f32": {"runs": ratios, "median": med(ratios)}}
c = res["configs"]
for kv in ("f32", "bf16"):
    b1, b32 = c.get("batch1_prompt16"), c.get("batch32_prompt16")
    if b1 and b32:
        res[f"batch32_vs_batch1_{kv}_kv"] = b32[f"{kv}_tok_s"]["median"] / b1[f"{kv}_tok_s"]["median"]
json.dump(res, open(out, "w"), indent=2)
print(f"kernels {kernels}, precision {precision}")
for k, v in c.items():
    print(f"{k}: f32 {v['f32_tok_s']['median']:.1f} tok/s, bf16 {v['bf16_tok_s']['median']:.1f} tok/s, "
          f"bf16/f32 {v['bf16_vs_f32']['median']:.3f} (pairs {', '.join(f'{x:.3f}' for x in v['bf16_vs_f32']['runs'])})")
for kv in ("f32", "bf16"):
    if f"batch32_vs_batch1_{kv}_kv" in res:
        print(f"batch 32 / batch 1 ({kv} KV, 16-token prompts): {res[f'batch32_vs_batch1_{kv}_kv']:.2f}")
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
