#!/usr/bin/env bash
# bench/gpu.sh: the CUDA backend on a Llama-2-7B-shaped model (random BF16 weights written by
# caraserve-mkmodel: 32 layers, hidden 4096, 32 heads, intermediate 11008, vocab 32000), on
# the GPU, beside the yardsticks measured in the same run (bench/gpubench: the GPU's read
# bandwidth and cuBLAS's own GEMM throughput on the same shapes):
#   - decode tokens/s at batch 1, 8, 32, 64 (`caraserve batch`, decode-only steps); at batch 1
#     the fraction of the read bandwidth used: weight bytes x tokens/s / bandwidth;
#   - prefill tokens/s at 512 and 2048 tokens (`caraserve generate --stats`), against cuBLAS's
#     GEMM time for the same tokens (the projections alone, a lower bound on the layer);
#   - LoRA overhead: batch 32 with 32 distinct adapters of ranks 8, 16, 32, 64 (all 7
#     projections) against the base model alone at batch 32.
# Writes bench/results/gpu-<time>.json with the device's name, the tables and the keys
# bandwidth_fraction_batch1 and lora_overhead_32_adapters (fractions).
#
#   bench/gpu.sh                    # needs a CUDA build and a GPU
#   SHAPE=tiny CS_TEST_DEVICE=cuda-emu bench/gpu.sh   # the script's own dry run, no GPU: a tiny
#                                   # model on the emulator; its numbers mean nothing
# Env: BUILD (build), CACHE (~/.cache/caraserve-bench), REPS (3), GEN (64), SHAPE (7b|tiny),
#      LAYERS (the 7B shape's, 32; tools/gpu-host.sh runs 4: the per-layer figures are the
#      same and the model is written in seconds)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build} REPS=${REPS:-3} GEN=${GEN:-64} SHAPE=${SHAPE:-7b}
CACHE=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/caraserve-bench}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$CACHE" bench/results
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$SHAPE" = tiny ]; then
    PROMPTS="32 64" BATCHES="1 8" NAD=8
else
    PROMPTS="512 2048" BATCHES="1 8 32 64" NAD=32
fi
. bench/gpu_model.sh
gpu_model "$SHAPE" "$NAD" # model and its NAD adapters

device=(--device cuda)
[ "${CS_TEST_DEVICE:-}" = cuda-emu ] && device=(--device cpu)

# the yardsticks
if [ -x "$BUILD/bench/gpubench" ] && [ "${CS_TEST_DEVICE:-}" != cuda-emu ]; then
    yard=$("$BUILD/bench/gpubench")
else
    yard='{"device": "none (dry run)", "read_gbps": null, "gemm": []}'
fi
echo "yardsticks: $yard" >&2

# decode: B requests of one prompt token each, GEN tokens, decode-only steps timed by the engine
decode() { # batch adapters -> the stats JSON line
    local b=$1 na=$2 f="$work/req-$1-$2.jsonl"
    $PY - "$b" "$na" "$GEN" > "$f" <<'EOF'
import json, sys
b, na, gen = map(int, sys.argv[1:])
for i in range(b):
    r = {"id": i, "prompt_ids": [1, 3 + i], "max_tokens": gen, "temperature": 0, "ignore_eos": True}
    if na:
        r["adapter"] = f"a{i % na}"
    print(json.dumps(r))
EOF
    local lora=()
    for i in $(seq 0 $((na - 1))); do lora+=(--lora "a$i=${adapters[$i]}"); done
    "$BUILD/caraserve" batch --model "$model" --requests "$f" "${device[@]}" --stats --preload-adapters \
        --max-num-seqs "$b" ${lora[@]+"${lora[@]}"} 2>"$work/err" >/dev/null ||
        { echo "gpu.sh: decode batch $b, $na adapters: caraserve batch failed:" >&2; tail -20 "$work/err" >&2; exit 1; }
    grep '^{' "$work/err" | tail -1
}

rows="$work/rows.jsonl"
: > "$rows"
for r in $(seq "$REPS"); do
    for b in $BATCHES; do
        st=$(decode "$b" 0)
        echo "{\"kind\": \"decode\", \"rep\": $r, \"batch\": $b, \"adapters\": 0, \"stats\": $st}" >> "$rows"
        echo "rep $r decode batch $b: $($PY -c "import json,sys; s=json.loads(sys.argv[1]); print(round(s['decode_only_tokens']/s['decode_only_ms']*1e3,1), 'tok/s')" "$st")" >&2
    done
    bl=$(echo "$BATCHES" | awk '{print $NF}')
    [ "$SHAPE" = tiny ] || bl=32
    st=$(decode "$bl" "$NAD")
    echo "{\"kind\": \"decode\", \"rep\": $r, \"batch\": $bl, \"adapters\": $NAD, \"stats\": $st}" >> "$rows"
    echo "rep $r decode batch $bl with $NAD adapters: $($PY -c "import json,sys; s=json.loads(sys.argv[1]); print(round(s['decode_only_tokens']/s['decode_only_ms']*1e3,1), 'tok/s')" "$st")" >&2
    for p in $PROMPTS; do
        ids=$($PY -c "import random; random.seed($p); print(','.join(str(random.randrange(3, 500)) for _ in range($p)))")
        "$BUILD/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens 1 "${device[@]}" --stats \
            2>"$work/err" >/dev/null ||
            { echo "gpu.sh: prefill $p: caraserve generate failed:" >&2; tail -20 "$work/err" >&2; exit 1; }
        line=$(grep '^stats:' "$work/err")
        pp=$(sed -E 's/.*prefill [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/' <<<"$line")
        echo "{\"kind\": \"prefill\", \"rep\": $r, \"tokens\": $p, \"tok_s\": $pp}" >> "$rows"
        echo "rep $r prefill $p: $pp tok/s" >&2
    done
done

out="bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ).json"
[ "${CS_TEST_DEVICE:-}" = cuda-emu ] && out="$work/gpu-dry-run.json"   # never a result
$PY - "$rows" "$model" "$yard" "$SHAPE" "${CS_TEST_DEVICE:-}" > "$out" <<'EOF'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
model, yard, shape, emu = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
cfg = json.load(open(os.path.join(model, "config.json")))
# the bytes a decode step reads: every tensor but the embedding table (one row a token), unless
# the output projection is tied to it
def tensor_bytes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in hdr.items() if k != "__metadata__"}
sizes = {}
for f in os.listdir(model):
    if f.endswith(".safetensors"):
        sizes.update(tensor_bytes(os.path.join(model, f)))
tied = cfg.get("tie_word_embeddings") or "lm_head.weight" not in sizes
weight_bytes = sum(v for k, v in sizes.items() if tied or k != "model.embed_tokens.weight")
med = statistics.median
dec = {}
for r in rows:
    if r["kind"] == "decode":
        s = r["stats"]
        dec.setdefault((r["batch"], r["adapters"]), []).append(s["decode_only_tokens"] / s["decode_only_ms"] * 1e3)
decode = [{"batch": b, "adapters": a, "tok_s": round(med(v), 2), "runs": [round(x, 2) for x in v]}
          for (b, a), v in sorted(dec.items())]
pre = {}
for r in rows:
    if r["kind"] == "prefill":
        pre.setdefault(r["tokens"], []).append(r["tok_s"])
gemm = {g["tokens"]: g for g in yard.get("gemm", [])}
prefill = []
for t, v in sorted(pre.items()):
    row = {"tokens": t, "tok_s": round(med(v), 1), "runs": v}
    if t in gemm:  # cuBLAS alone on the projections of all layers, as tokens/s
        row["cublas_gemm_tok_s"] = round(t / (gemm[t]["layer_ms"] * 1e-3 * cfg["num_hidden_layers"]), 1)
        row["fraction_of_cublas"] = round(row["tok_s"] / row["cublas_gemm_tok_s"], 3)
    prefill.append(row)
b1 = dec.get((1, 0))
bw = yard.get("read_gbps")
frac = round(weight_bytes * med(b1) / (bw * 1e9), 3) if b1 and bw else None
lo = [d for d in decode if d["adapters"] > 0]
overhead = None
if lo:
    base = next((d for d in decode if d["adapters"] == 0 and d["batch"] == lo[0]["batch"]), None)
    if base:
        overhead = round(base["tok_s"] / lo[0]["tok_s"] - 1, 4)
print(json.dumps({
    "bench": "gpu", "device": yard.get("device"), "simulated": bool(emu),
    "note": "dry run on the CUDA emulator: the numbers mean nothing" if emu else "",
    "model": {"shape": shape, "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
              "intermediate": cfg["intermediate_size"], "vocab": cfg["vocab_size"], "dtype": "bf16",
              "weight_bytes": weight_bytes},
    "read_gbps": bw, "decode": decode, "prefill": prefill,
    "bandwidth_fraction_batch1": frac, "lora_overhead_32_adapters": overhead,
    "kernel_path": "cuBLAS GemmEx BF16 in, F32 accumulate; paged attention (warp per row and head, 32-key tiles); "
                   "grouped LoRA shrink/expand",
}, indent=1))
EOF
"$PY" bench/machine.py "$out" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
echo "wrote $out" >&2
cat "$out"
