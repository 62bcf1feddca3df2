#!/usr/bin/env bash
# bench/compare.sh: caraserve-bench, unchanged, against caraserve and against llama.cpp's
# llama-server in one run, on the same ~200M Llama checkpoint (bench/common.sh: BF16 safetensors
# for caraserve, its F16 GGUF for llama-server) and the same seeded schedule: Poisson arrivals at
# RATE requests/s for DURATION s, IN-token prompts (token ids, +-25%), OUT new tokens each
# (ignore_eos), an SLO of ttft:TTFT_MS tpot:TPOT_MS. The schedule is drawn once (--dump-schedule)
# and replayed on both servers (--dataset-name trace). A third run sends a schedule of the same
# shape to caraserve over three adapters of ranks 8/16/64 (zipf:1.0 popularity, 20% base model),
# which llama-server does not serve. One server runs at a time, so each has the cores to itself.
# Each run's JSON and the summary land in bench/results/compare-<time>.json.
#
#   bench/compare.sh                                  (llama.cpp at /work/llama.cpp, or:)
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/compare.sh  (needs build/bin/llama-server, convert_hf_to_gguf.py, gguf-py/)
# Env: BUILD (build), THREADS (2), RATE (1.0), DURATION (30), IN (64), OUT (64), TTFT_MS (2000),
#      TPOT_MS (100), SLOTS (16), SEED (1), CACHE, DTYPE (bf16)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RATE=${RATE:-1.0} DURATION=${DURATION:-30} IN=${IN:-64} OUT=${OUT:-64} TTFT_MS=${TTFT_MS:-2000}
TPOT_MS=${TPOT_MS:-100} SLOTS=${SLOTS:-16} SEED=${SEED:-1}
if [ -z "${LLAMA_CPP_DIR:-}" ] && [ -x /work/llama.cpp/build/bin/llama-server ]; then LLAMA_CPP_DIR=/work/llama.cpp; fi
. bench/common.sh
BENCH="$BUILD/caraserve-bench"
[ -x "$BENCH" ] || { echo "compare.sh: build $BENCH first (make -C $BUILD)" >&2; exit 1; }
work=$(mktemp -d)
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
cleanup() { stop; rm -rf "$work"; }
trap cleanup EXIT
lora_mods=()
for r in 8 16 64; do
    a="$CACHE/llama-200m-lora-r$r"
    [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank "$r" \
        --alpha $((2 * r)) --seed $((60 + r)) >&2
    lora_mods+=("r$r=$a")
done
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() { # port
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "compare.sh: the server on port $1 did not come up" >&2; return 1
}
common=(--request-rate "$RATE" --duration "$DURATION" --random-input-len "$IN" --random-output-len "$OUT"
        --random-range-ratio 0.25 --vocab-size 32000 --seed "$SEED" --goodput "ttft:$TTFT_MS" "tpot:$TPOT_MS"
        --metric-percentiles 50,90,99 --save-result --result-dir "$work")

# the schedule, drawn once
"$BENCH" "${common[@]}" --dump-schedule "$work/base.csv" --dry-run >&2

port=$(free_port)
echo "== caraserve serve ($model)" >&2
"$BUILD/caraserve" serve --model "$model" --served-model-name llama-200m --port "$port" --threads "$THREADS" \
    --kv-cache-bytes 2G --lora-modules "${lora_mods[@]}" 2> "$work/cs.log" &
pid=$!
wait_health "$port"
"$BENCH" --base-url "http://127.0.0.1:$port" --model llama-200m --dataset-name trace --dataset-path "$work/base.csv" \
    "${common[@]}" --result-filename caraserve.json --label caraserve
echo "== caraserve serve, three adapters (ranks 8/16/64, zipf:1.0, 20% base)" >&2
"$BENCH" --base-url "http://127.0.0.1:$port" --model llama-200m --lora-modules r8:8 r16:16 r64:64 --popularity zipf:1.0 \
    --base-fraction 0.2 "${common[@]}" --per-adapter --per-rank --result-filename caraserve-lora.json --label caraserve-lora \
    --plot "$work/caraserve-lora.svg"
stop

ll=""
if [ -n "$gguf" ] && [ -x "$LLAMA_CPP_DIR/build/bin/llama-server" ]; then
    port=$(free_port)
    echo "== llama-server ($gguf, $SLOTS slots)" >&2
    "$LLAMA_CPP_DIR/build/bin/llama-server" -m "$gguf" --port "$port" -t "$THREADS" -np "$SLOTS" \
        -c $((SLOTS * (IN * 5 / 4 + OUT + 16))) -b 2048 --no-warmup > "$work/ll.log" 2>&1 &
    pid=$!
    wait_health "$port"
    # no --model: the bench takes the first of /v1/models, as it would from any OpenAI-compatible server
    "$BENCH" --base-url "http://127.0.0.1:$port" --dataset-name trace --dataset-path "$work/base.csv" "${common[@]}" \
        --result-filename llama-server.json --label llama-server
    stop
    ll="$work/llama-server.json"
else
    echo "compare.sh: no llama-server (set LLAMA_CPP_DIR to a llama.cpp with build/bin/llama-server)" >&2
fi

ts=$(date -u +%Y%m%dT%H%M%SZ)
out="bench/results/compare-$ts.json"
$PY - "$out" "$work/caraserve.json" "$work/caraserve-lora.json" "$ll" "$THREADS" "$(nproc)" <<'PYEOF'
import json, sys
out, paths = sys.argv[1], {"caraserve": sys.argv[2], "caraserve_3_adapters": sys.argv[3], "llama_server": sys.argv[4]}
runs = {k: json.load(open(p)) for k, p in paths.items() if p}
keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "max_output_tokens_per_s",
        "max_concurrent_requests", "max_concurrent_requests_exact", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
        "mean_e2el_ms", "p99_e2el_ms", "request_goodput"]
summary = {}
for k, r in runs.items():
    s = {key: (round(r[key], 2) if isinstance(r[key], float) else r[key]) for key in keys}
    s["slo_attainment"] = round(r["slo_attainment"]["all"], 3)
    summary[k] = s
if "llama_server" in runs:
    a, b = runs["caraserve"], runs["llama_server"]
    summary["caraserve_over_llama_server"] = {
        "output_throughput": round(a["output_throughput"] / b["output_throughput"], 2),
        "mean_ttft": round(b["mean_ttft_ms"] / a["mean_ttft_ms"], 2),
        "mean_tpot": round(b["mean_tpot_ms"] / a["mean_tpot_ms"], 2)}
res = {"bench": "compare", "device": "cpu", "threads": int(sys.argv[5]), "nproc": int(sys.argv[6]),
       "workload": runs["caraserve"]["config"], "summary": summary, "runs": runs}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
print("wrote", out)
PYEOF
bench_stamp "$out"
