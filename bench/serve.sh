#!/usr/bin/env bash
# bench/serve.sh: `caraserve serve` under concurrent streaming clients (bench/serve_client.py)
# on the ~200M Llama of bench/common.sh, side by side in one run:
#   - output tokens/s, mean TTFT and inter-token latency at concurrency 1, 8 and 32
#     (64-token prompts, GEN new tokens each, greedy), base model only;
#   - the same at concurrency 8 and 32 with every request on one of 8 rank-16 adapters;
#   - the same requests through `caraserve batch` (no HTTP; --max-num-seqs = the clients;
#     timed from first submit to last token), so the HTTP layer's cost shows as a ratio;
#   - with LLAMA_CPP_DIR (llama-server built), llama.cpp's server on the F16 GGUF of the same
#     checkpoint with as many parallel slots as clients.
# Configurations alternate within each repetition; the JSON lands in bench/results/.
#
#   bench/serve.sh
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/serve.sh     (needs build/bin/llama-server, convert_hf_to_gguf.py, gguf-py/)
# Env: BUILD (build), THREADS (2), GEN (64), REPS (2), CACHE, DTYPE (bf16)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-64} REPS=${REPS:-2} PLEN=64
. bench/common.sh
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
lora_mods=()
for i in 0 1 2 3 4 5 6 7; do
    a="$CACHE/llama-200m-lora-r16-$i"
    [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank 16 \
        --alpha 32 --seed $((40 + i)) >&2
    lora_mods+=("ad$i=$a")
done
adapters=ad0,ad1,ad2,ad3,ad4,ad5,ad6,ad7

free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() { # port
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "server on port $1 did not come up" >&2; return 1
}

cs_port=$(free_port)
"$BUILD/caraserve" serve --model "$model" --port "$cs_port" --threads "$THREADS" --kv-cache-bytes 2G \
    --lora-modules "${lora_mods[@]}" 2> "$work/cs.log" &
pids+=($!)
wait_health "$cs_port"
ll_port=""
if [ -n "${LLAMA_CPP_DIR:-}" ] && [ -x "$LLAMA_CPP_DIR/build/bin/llama-server" ] && [ -n "$gguf" ]; then
    ll_port=$(free_port)
    "$LLAMA_CPP_DIR/build/bin/llama-server" -m "$gguf" --port "$ll_port" -t "$THREADS" -np 32 \
        -c $((32 * (PLEN + GEN + 16))) -b 2048 --no-warmup 2> "$work/ll.log" >&2 &
    pids+=($!)
    wait_health "$ll_port"
fi

# the same requests as JSON lines for caraserve batch (what serve_client.py sends, non-streamed)
mkbatch() { # N models -> file
    $PY - "$1" "$2" "$GEN" "$PLEN" > "$work/batch-$1-$2.jsonl" <<'PYEOF'
import json, random, sys
n, models, gen, plen = int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m], int(sys.argv[3]), int(sys.argv[4])
rnd = random.Random(1)
for i in range(n):
    r = {"prompt_ids": [rnd.randrange(3, 32000) for _ in range(plen)], "max_tokens": gen, "ignore_eos": True,
         "temperature": 0}
    if models:
        r["adapter"] = models[i % len(models)]
    print(json.dumps(r))
PYEOF
    echo "$work/batch-$1-$2.jsonl"
}

results="$work/runs.jsonl"
: > "$results"
lora_batch=()
for m in "${lora_mods[@]}"; do lora_batch+=(--lora "$m"); done
for r in $(seq "$REPS"); do
    for c in 1 8 32; do
        n=$((c * 2))
        for models in "" "$adapters"; do
            [ "$c" = 1 ] && [ -n "$models" ] && continue
            tag=$([ -n "$models" ] && echo 8ad || echo base)
            out=$($PY bench/serve_client.py "http://127.0.0.1:$cs_port" --concurrency "$c" --requests "$n" \
                --gen "$GEN" --prompt-len "$PLEN" --models "$models")
            echo "{\"kind\": \"caraserve-serve\", \"rep\": $r, \"c\": $c, \"adapters\": \"$tag\", \"out\": $out}" >> "$results"
            # the engine alone on the same requests, c at a time (--max-num-seqs c)
            f=$(mkbatch "$n" "$models")
            # (its --stats wall_ms: first submit to last token, without loading the model)
            "$BUILD/caraserve" batch --model "$model" "${lora_batch[@]}" --threads "$THREADS" --kv-cache-bytes 2G \
                --max-num-seqs "$c" --requests "$f" --stats > /dev/null 2> "$work/stats"
            wall=$(tail -n 1 "$work/stats" | $PY -c 'import json, sys; print(json.load(sys.stdin)["wall_ms"] / 1000)')
            echo "{\"kind\": \"caraserve-batch\", \"rep\": $r, \"c\": $c, \"adapters\": \"$tag\", \"wall_s\": $wall, \"tokens\": $((n * GEN))}" >> "$results"
            if [ -n "$ll_port" ] && [ -z "$models" ]; then
                out=$($PY bench/serve_client.py "http://127.0.0.1:$ll_port" --concurrency "$c" --requests "$n" \
                    --gen "$GEN" --prompt-len "$PLEN")
                echo "{\"kind\": \"llama-server\", \"rep\": $r, \"c\": $c, \"adapters\": \"base\", \"out\": $out}" >> "$results"
            fi
        done
    done
done

ts=$(date -u +%Y%m%dT%H%M%SZ)
$PY - "$results" "bench/results/serve-$ts.json" "$THREADS" "$GEN" "$(nproc)" <<'PYEOF'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
def best(kind, c, ad):
    rs = [r for r in runs if r["kind"] == kind and r["c"] == c and r["adapters"] == ad]
    if not rs:
        return None
    if kind == "caraserve-batch":
        return max(r["tokens"] / r["wall_s"] for r in rs)
    return max(rs, key=lambda r: r["out"]["tokens_per_s"])["out"]
summary = {}
for c in (1, 8, 32):
    for ad in ("base", "8ad"):
        s = best("caraserve-serve", c, ad)
        if not s:
            continue
        b = best("caraserve-batch", c, ad)
        row = {"serve_tok_s": round(s["tokens_per_s"], 1), "ttft_mean_ms": round(1000 * s["ttft_mean_s"], 1),
               "itl_mean_ms": round(1000 * s["itl_mean_s"], 2), "batch_tok_s": round(b, 1) if b else None,
               "serve_over_batch": round(s["tokens_per_s"] / b, 3) if b else None}
        l = best("llama-server", c, ad)
        if l:
            row.update({"llama_server_tok_s": round(l["tokens_per_s"], 1),
                        "llama_server_ttft_mean_ms": round(1000 * l["ttft_mean_s"], 1),
                        "llama_server_itl_mean_ms": round(1000 * l["itl_mean_s"], 2),
                        "caraserve_over_llama_server": round(s["tokens_per_s"] / l["tokens_per_s"], 2)})
        summary[f"c{c}_{ad}"] = row
res = {"bench": "serve", "device": "cpu", "threads": int(sys.argv[3]), "gen": int(sys.argv[4]),
       "nproc": int(sys.argv[5]), "summary": summary, "runs": runs}
json.dump(res, open(sys.argv[2], "w"), indent=1)
print(json.dumps(summary, indent=1))
print("wrote", sys.argv[2])
PYEOF
"$PY" bench/machine.py "bench/results/serve-$ts.json" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
