#!/usr/bin/env bash
# bench/coldserve.sh: cold starts under load, as CaraServe measures them. `caraserve serve`
# with NAD adapters (128) named a0..a<NAD-1>, requests drawn by caraserve-bench with
# CaraServe's measured popularity (tests/data/bench/maf-popularity-128.csv) and Poisson
# arrivals at RATE requests/s, and only SLOTS device slots (--max-loras), so a request for
# one of the many unpopular adapters finds it cold. The same schedule (one seed) runs on a
# fresh server once with --cold-start cpu-assist and once with wait; rows {"mode",
# "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "request_throughput",
# "cold_starts"} (the server's caraserve_cold_starts_total) go to bench/results/coldserve-*.json.
#
#   DEVICE=cuda bench/coldserve.sh   # on an NVIDIA GPU: the 7B-shaped BF16 model and the 32
#                                    # adapters of bench/gpu.sh (ranks 8/16/32/64), names
#                                    # a<i> on adapter i mod 32 (a slot each all the same)
#   bench/coldserve.sh               # SIMULATED: the strict test device (CPU kernels behind a
#                                    # copy link of GBPS GB/s) with a ~50M model and adapters
#                                    # of ranks 8-64 (bench/lora16.sh's), labelled so
# Env: BUILD (build), THREADS (2), DEVICE (strict|cuda), GBPS (25), NAD (128), SLOTS (8),
#      N (requests: 300 cuda, 60 strict), RATE (8 cuda, 1 strict), IN (256), OUT (32), SEED (1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE=${DEVICE:-strict} GBPS=${GBPS:-25} NAD=${NAD:-128} SLOTS=${SLOTS:-8} IN=${IN:-256} OUT=${OUT:-32} SEED=${SEED:-1}
if [ "$DEVICE" = cuda ]; then N=${N:-300} RATE=${RATE:-8}; else N=${N:-60} RATE=${RATE:-1}; fi
. bench/common.sh
BENCH="$BUILD/caraserve-bench"
work=$(mktemp -d)
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap 'stop; rm -rf "$work"' EXIT

http_get() { $PY -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() { # port: a 7B model takes a while to load
    for _ in $(seq 3000); do http_get "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "coldserve.sh: nothing answers /health on port $1" >&2; return 1
}

envs=() devflag=(--device "$DEVICE")
if [ "$DEVICE" = cuda ]; then
    . bench/gpu_model.sh
    gpu_model 7b 32   # bench/gpu.sh's model and adapters
    dirs=()
    for i in "${!adapters[@]}"; do dirs+=("${adapters[$i]}:$((8 << (i % 4)))"); done
    desc="llama 7B-shaped (hidden 4096, 32 layers, intermediate 11008, vocab 32000), BF16"
else
    . bench/lora16.sh   # $model (~50M) and its 16 adapters; free_port, wait_health
    dirs=()
    for i in $(seq 0 15); do dirs+=("$CACHE/llama-50m-lora-r$((8 << (i % 4)))-$i:$((8 << (i % 4)))"); done
    envs=(CS_TEST_DEVICE=strict "CS_STRICT_GBPS=$GBPS")
    devflag=(--device cpu)
    desc="llama ~50M (512 hidden, 8 layers), BF16, on the strict test device (SIMULATED)"
fi

# a<i> on file i mod the distinct ones; caraserve-bench gets each name's rank and its share
mods=() bench_mods=()
tail -n +2 tests/data/bench/maf-popularity-128.csv | head -"$NAD" > "$work/pop"
[ "$(wc -l < "$work/pop")" -ge "$NAD" ] || { echo "coldserve.sh: NAD=$NAD: the popularity file has fewer adapters" >&2; exit 2; }
for i in $(seq 0 $((NAD - 1))); do
    d=${dirs[$((i % ${#dirs[@]}))]}
    mods+=("a$i=${d%:*}")
    bench_mods+=("a$i:${d##*:}:$(sed -n "$((i + 1))p" "$work/pop" | cut -d, -f2)")
done

: > "$work/rows.jsonl"
for mode in cpu-assist wait; do
    stop
    port=$(free_port)
    env ${envs[@]+"${envs[@]}"} "$BUILD/caraserve" serve --model "$model" --served-model-name m --port "$port" \
        --threads "$THREADS" "${devflag[@]}" --max-loras "$SLOTS" --cold-start "$mode" --lora-modules "${mods[@]}" \
        2> "$work/serve-$mode.log" &
    pid=$!
    wait_health "$port" || { tail -20 "$work/serve-$mode.log" >&2; exit 1; }
    "$BENCH" --base-url "http://127.0.0.1:$port" --model m --lora-modules "${bench_mods[@]}" --popularity trace \
        --num-prompts "$N" --request-rate "$RATE" --seed "$SEED" --random-input-len "$IN" --random-output-len "$OUT" \
        --metric-percentiles 50,99 --save-result --result-dir "$work" --result-filename "$mode.json" --label "$mode" \
        > "$work/$mode.txt" || { echo "coldserve.sh: caraserve-bench failed ($mode):" >&2; tail -20 "$work/$mode.txt" >&2; exit 1; }
    http_get "http://127.0.0.1:$port/metrics" > "$work/metrics-$mode.txt" || true
    stop
    $PY - "$mode" "$work/$mode.json" "$work/metrics-$mode.txt" >> "$work/rows.jsonl" <<'PYEOF'
import json, re, sys
mode, res, metrics = sys.argv[1:4]
r = json.load(open(res))
cold = {}
for line in open(metrics):
    m = re.match(r'^caraserve_cold_starts_total\{[^}]*mode="([a-z_]+)"[^}]*\}\s+(\S+)', line)
    if m:
        cold[m.group(1)] = float(m.group(2))
print(json.dumps({"mode": mode, "mean_ttft_ms": r.get("mean_ttft_ms"), "p50_ttft_ms": r.get("p50_ttft_ms"),
                  "p99_ttft_ms": r.get("p99_ttft_ms"), "p99_tpot_ms": r.get("p99_tpot_ms"),
                  "request_throughput": r.get("request_throughput"), "failed": r.get("failed", 0),
                  "cold_starts": cold}))
PYEOF
    echo "coldserve.sh: $mode: $(tail -1 "$work/rows.jsonl")" >&2
done

out="bench/results/coldserve-$([ "$DEVICE" = strict ] && echo sim- || true)$(date -u +%Y%m%dT%H%M%SZ).json"
gpu=""
[ "$DEVICE" = cuda ] && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
$PY - "$work/rows.jsonl" "$out" "$DEVICE" "$GBPS" "$gpu" "$desc" "$NAD" "$SLOTS" "$N" "$RATE" "$IN" "$OUT" "$THREADS" <<'PYEOF'
import json, sys
rows_p, out, device, gbps, gpu, desc, nad, slots, n, rate, inp, outp, threads = sys.argv[1:14]
rows = [json.loads(l) for l in open(rows_p)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
sim = device == "strict"
by = {r["mode"]: r for r in rows}
res = {"benchmark": "coldserve", "simulated": sim,
       "device": (f"strict test device: the CPU kernels behind a simulated {gbps} GB/s copy link (SIMULATED, not a GPU)"
                  if sim else (gpu or "cuda")),
       "cpu": cpu, "threads": int(threads), "model": desc,
       "adapters": int(nad), "device_slots": int(slots), "popularity": "tests/data/bench/maf-popularity-128.csv",
       "requests": int(n), "request_rate": float(rate), "input_tokens": int(inp), "output_tokens": int(outp),
       "rows": rows}
if "cpu-assist" in by and "wait" in by and by["cpu-assist"].get("mean_ttft_ms"):
    res["wait_over_cpu_assist_mean_ttft"] = by["wait"]["mean_ttft_ms"] / by["cpu-assist"]["mean_ttft_ms"]
    if by["cpu-assist"].get("p99_ttft_ms"):
        res["wait_over_cpu_assist_p99_ttft"] = by["wait"]["p99_ttft_ms"] / by["cpu-assist"]["p99_ttft_ms"]
json.dump(res, open(out, "w"), indent=2)
print(out)
PYEOF
bench_stamp "$out"
echo "wrote $out" >&2
cat "$out"
