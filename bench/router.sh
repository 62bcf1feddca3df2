#!/usr/bin/env bash
# bench/router.sh: `caraserve router` over 3 `caraserve serve` replicas on loopback, its three
# policies on the same schedules in one run, and what the router costs a request.
#
# Part 1, policies: the ~50M Llama of bench/slo.sh with its 16 adapters (ranks 8/16/32/64 in
# turn, all 7 projections, CaraServe's measured popularity), served by 3 replicas (each
# --threads 1 --scheduler slo --no-prefix-caching, so a run leaves nothing behind but the cost
# models, which keep learning). Capacity: the throughput of round-robin with every request sent
# at once. For each load in LOADS and each policy, a fresh router and the same Poisson
# schedule (one seed); requests carry their SLOs (TTFT ≤ TTFT_MS, TPOT ≤ 1.5 × the base
# model's median TPOT through the router at 50% load). Rows {"policy", "load",
# "slo_attainment", "p99_ttft_ms", "p99_tpot_ms"} go to bench/results/router-*.json.
# The replicas share this machine's cores (and with the router and the load generator): on a
# 2-core machine they are three schedulers competing for the same CPU, which is what the
# numbers measure, not three machines.
#
# Part 2, overhead: OVERHEAD_N tiny completions (max_tokens 1), one at a time, alternating
# straight to replica 0 and through a router that has only replica 0; the median of each and
# the median of the paired differences.
#
#   bench/router.sh
# Env: BUILD (build), LOADS ("0.8 1.0 1.2"), N (requests per run: 120), IN (64), OUT (32),
#      TTFT_MS (3000), WARM (48), SEED (1), OVERHEAD_N (400), POLICIES, CACHE
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOADS=${LOADS:-"0.8 1.0 1.2"} N=${N:-120} IN=${IN:-64} OUT=${OUT:-32} TTFT_MS=${TTFT_MS:-3000} WARM=${WARM:-48}
SEED=${SEED:-1} OVERHEAD_N=${OVERHEAD_N:-400} POLICIES=${POLICIES:-"round-robin least-loaded rank-aware"}
. bench/common.sh
BENCH="$BUILD/caraserve-bench"
work=$(mktemp -d)
pids=() rpid=""
stop_router() { if [ -n "$rpid" ]; then kill "$rpid" 2>/dev/null || true; wait "$rpid" 2>/dev/null || true; rpid=""; fi; }
cleanup() { stop_router; for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

. bench/lora16.sh
rports=()
for k in 0 1 2; do
    p=$(free_port)
    "$BUILD/caraserve" serve --model "$model" --served-model-name m --port "$p" --threads 1 --kv-cache-bytes 512M \
        --lora-modules "${mods[@]}" --scheduler slo --no-prefix-caching --profile-cost-model 1 \
        2> "$work/replica-$k.log" &
    pids+=($!)
    rports+=("$p")
    wait_health "$p" # one at a time: each profiles its cost model on an otherwise idle machine
done
replica_args=()
for p in "${rports[@]}"; do replica_args+=(--replica "http://127.0.0.1:$p"); done
rport=""
start_router() { # policy [replica args...]
    stop_router
    rport=$(free_port)
    local pol=$1
    shift
    "$BUILD/caraserve" router --port "$rport" --policy "$pol" "$@" 2> "$work/router-$pol.log" &
    rpid=$!
    wait_health "$rport"
}
run() { # label out-json args...
    local label=$1 out=$2
    shift 2
    "$BENCH" --base-url "http://127.0.0.1:$rport" --model m --random-input-len "$IN" --random-output-len "$OUT" \
        --random-range-ratio 0.5 --num-prompts "$N" --seed "$SEED" --metric-percentiles 50,99 --save-result \
        --result-dir "$work" --result-filename "$out" --label "$label" "$@" > "$work/$label.txt"
}

start_router round-robin "${replica_args[@]}"
# every replica's adapters loaded and its cost model refined on the mix
"$BENCH" --base-url "http://127.0.0.1:$rport" --model m --lora-modules "${bench_mods[@]}" --popularity trace \
    --num-prompts "$WARM" --request-rate inf --random-input-len "$IN" --random-output-len "$OUT" \
    --random-range-ratio 0.5 --seed 999 > /dev/null
run capacity capacity.json --lora-modules "${bench_mods[@]}" --popularity trace --request-rate inf
cap=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" "$work/capacity.json")
run base base.json --request-rate "$($PY -c "print(0.5 * $cap)")"
base_tpot=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['median_tpot_ms'])" "$work/base.json")
tpot_slo=$($PY -c "print(round(1.5 * $base_tpot, 3))")
echo "router.sh: capacity $cap requests/s over 3 replicas; base TPOT $base_tpot ms: SLOs TTFT $TTFT_MS ms, TPOT $tpot_slo ms" >&2

for load in $LOADS; do
    rate=$($PY -c "print($load * $cap)")
    for policy in $POLICIES; do
        start_router "$policy" "${replica_args[@]}"
        run "$policy-$load" "$policy-$load.json" --lora-modules "${bench_mods[@]}" --popularity trace \
            --request-rate "$rate" --goodput "ttft:$TTFT_MS" "tpot:$tpot_slo" \
            --extra-body "{\"slo\": {\"ttft_ms\": $TTFT_MS, \"tpot_ms\": $tpot_slo}}"
        echo "router.sh: $policy at $load: $($PY -c "import json,sys; r=json.load(open(sys.argv[1])); print('attainment', r['slo_attainment']['all'], 'p99 TTFT', r.get('p99_ttft_ms'), 'failed', r.get('failed'))" "$work/$policy-$load.json")" >&2
    done
done

# part 2: the router's own cost, paired with the replica's own time
start_router round-robin --replica "http://127.0.0.1:${rports[0]}"
$PY - "${rports[0]}" "$rport" "$OVERHEAD_N" > "$work/overhead.json" <<'PYEOF'
import http.client, json, statistics, sys, time
direct, via, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=60) for p in (direct, via)}
body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0})
def once(p):
    c = conns[p]
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
    return (time.perf_counter() - t0) * 1000
for _ in range(20):  # connections and caches warm
    once(direct), once(via)
d, v = [], []
for i in range(n):
    a, b = (direct, via) if i % 2 == 0 else (via, direct)
    x, y = once(a), once(b)
    (d if a == direct else v).append(x)
    (v if b == via else d).append(y)
diffs = [b - a for a, b in zip(d, v)]
print(json.dumps({"requests": n, "median_direct_ms": statistics.median(d), "median_via_router_ms": statistics.median(v),
                  "median_paired_diff_ms": statistics.median(diffs)}))
PYEOF
stop_router
echo "router.sh: overhead $(cat "$work/overhead.json")" >&2

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out="bench/results/router-$stamp.json"
$PY - "$work" "$out" "$LOADS" "$cap" "$TTFT_MS" "$tpot_slo" "$N" "$POLICIES" <<'PYEOF'
import json, os, sys
work, out, loads, cap, ttft_ms, tpot_slo, n, policies = sys.argv[1:9]
rows = []
for load in loads.split():
    for policy in policies.split():
        r = json.load(open(os.path.join(work, f"{policy}-{load}.json")))
        rows.append({"policy": policy, "load": float(load), "slo_attainment": (r.get("slo_attainment") or {}).get("all"),
                     "p99_ttft_ms": r.get("p99_ttft_ms"), "p99_tpot_ms": r.get("p99_tpot_ms"),
                     "median_ttft_ms": r.get("median_ttft_ms"), "request_throughput": r.get("request_throughput"),
                     "failed": r.get("failed", 0)})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
res = {"benchmark": "router", "cpu": cpu, "cores": os.cpu_count(), "replicas": 3, "replica_threads": 1,
       "replica_scheduler": "slo", "model": "llama ~50M (512 hidden, 8 layers, inter 1408, vocab 32000), BF16",
       "adapters": "16, ranks 8/16/32/64 in turn, all 7 projections, BF16; popularity: maf-popularity-128 top 16",
       "capacity_rps": float(cap), "ttft_slo_ms": float(ttft_ms), "tpot_slo_ms": float(tpot_slo),
       "tpot_slo": "1.5 x the base model's median TPOT through the router at 50% load", "requests_per_run": int(n),
       "rows": rows, "overhead": json.load(open(os.path.join(work, "overhead.json")))}
json.dump(res, open(out, "w"), indent=2)
for r in rows:
    print(f"{r['policy']:12s} load {r['load']:.2f}: attainment {r['slo_attainment']}, p99 TTFT {r['p99_ttft_ms']} ms, "
          f"failed {r['failed']}")
print("overhead", res["overhead"])
print(out)
PYEOF
bench_stamp "$out"
