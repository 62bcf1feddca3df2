#!/usr/bin/env bash
# bench/slo.sh: the rank-aware `slo` policy against `fcfs` under load, on the same schedules,
# in one run. A ~50M Llama (hidden 512, 8 layers, BF16) with 16 adapters, ranks uniform over
# {8, 16, 32, 64} on all 7 projections, CaraServe's measured popularity
# (tests/data/bench/maf-popularity-128.csv: the first 16 adapters' shares), Poisson arrivals at
# LOADS × the measured capacity. Capacity: the throughput (requests/s) of fcfs on the same
# mix with every request sent at once. SLOs (CaraServe's definition): TPOT ≤ 1.5 × the base
# model's TPOT at the same batch size: with SLO_BASE=batch (the default) the median TPOT of the
# base model alone held at as many requests in flight as the adapter mix has under fcfs at that
# load (Little's law on a probe run: throughput × mean E2E latency), with SLO_BASE=per-load the
# base model alone at the same arrival rate (fewer in flight: it finishes sooner, so a
# stricter bound), with SLO_BASE=fixed the per-load one at 50% load for every load;
# TTFT ≤ TTFT_MS. A request meets its SLO when both hold (caraserve-bench --goodput; a failed
# request misses). Every configuration runs on a fresh server; the schedule of a load is the
# same for both policies (one seed). The policy warms its cost model on WARM requests first.
# Rows {"policy", "load", "slo_attainment", "p99_ttft_ms", "p99_tpot_ms"} with the CPU's name go
# to bench/results/slo-*.json, and an SVG of attainment against load beside it.
#
#   bench/slo.sh
# Env: BUILD (build), THREADS (2), LOADS ("0.5 0.8 1.0 1.2"), N (requests per run: 160), IN (64),
#      OUT (32), TTFT_MS (3000), WARM (40), SEED (1), SLO_BASE (batch | per-load | fixed), CACHE,
#      SEND_SLO (1: every request carries the SLOs it is judged by, "slo": {"ttft_ms", "tpot_ms"},
#      as a client states them; fcfs ignores them; 0: none, the slo policy uses its defaults),
#      KEEP_WORK (a directory: the runs' JSON, per-request arrays included, and server logs go there)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOADS=${LOADS:-"0.5 0.8 1.0 1.2"} N=${N:-160} IN=${IN:-64} OUT=${OUT:-32} TTFT_MS=${TTFT_MS:-3000} WARM=${WARM:-40}
SEED=${SEED:-1} SLO_BASE=${SLO_BASE:-batch} SEND_SLO=${SEND_SLO:-1}
export SEND_SLO
. bench/common.sh
BENCH="$BUILD/caraserve-bench"
work=$(mktemp -d)
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
cleanup() { stop; if [ -n "${KEEP_WORK:-}" ]; then rm -rf "$KEEP_WORK"; mv "$work" "$KEEP_WORK"; else rm -rf "$work"; fi; }
trap cleanup EXIT

. bench/lora16.sh
port=""
start() { # policy
    stop
    port=$(free_port)
    "$BUILD/caraserve" serve --model "$model" --served-model-name m --port "$port" --threads "$THREADS" \
        --kv-cache-bytes 1G --lora-modules "${mods[@]}" --scheduler "$1" 2> "$work/serve-$1.log" &
    pid=$!
    wait_health "$port"
    # the cost model learns from these (and every later step)
    "$BENCH" --base-url "http://127.0.0.1:$port" --model m --lora-modules "${bench_mods[@]}" --popularity trace \
        --num-prompts "$WARM" --request-rate inf --random-input-len "$IN" --random-output-len "$OUT" \
        --random-range-ratio 0.5 --seed 999 > /dev/null
}
run() { # label out-json args...
    local label=$1 out=$2
    shift 2
    "$BENCH" --base-url "http://127.0.0.1:$port" --model m --random-input-len "$IN" --random-output-len "$OUT" \
        --random-range-ratio 0.5 --num-prompts "$N" --seed "$SEED" --metric-percentiles 50,99 --save-result \
        --result-dir "$work" --result-filename "$out" --label "$label" --save-detailed "$@" > "$work/$label.txt"
}

# capacity: fcfs with everything at once
start fcfs
run capacity capacity.json --lora-modules "${bench_mods[@]}" --popularity trace --request-rate inf
cap=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" "$work/capacity.json")
echo "slo.sh: capacity $cap requests/s" >&2
# the base model's TPOT at 50% load: the SLO is 1.5x it
rate=$($PY -c "print(0.5 * $cap)")
run base base.json --request-rate "$rate"
base_tpot=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['median_tpot_ms'])" "$work/base.json")
tpot_slo=$($PY -c "print(round(1.5 * $base_tpot, 3))")
echo "slo.sh: base TPOT ${base_tpot} ms: TPOT SLO ${tpot_slo} ms, TTFT SLO ${TTFT_MS} ms" >&2

for load in $LOADS; do
    rate=$($PY -c "print($load * $cap)")
    if [ "$SLO_BASE" = per-load ]; then
        start fcfs
        run "base-$load" "base-$load.json" --request-rate "$rate"
        base_tpot=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['median_tpot_ms'])" "$work/base-$load.json")
        tpot_slo=$($PY -c "print(round(1.5 * $base_tpot, 3))")
        echo "slo.sh: load $load: base TPOT ${base_tpot} ms: TPOT SLO ${tpot_slo} ms" >&2
    elif [ "$SLO_BASE" = batch ]; then
        # the batch size the mix runs at under fcfs at this load (Little: throughput × mean
        # E2E latency = requests in flight), then the base model held at that many in flight
        start fcfs
        run "probe-$load" "probe-$load.json" --lora-modules "${bench_mods[@]}" --popularity trace --request-rate "$rate"
        conc=$($PY -c "import json,sys,math; r=json.load(open(sys.argv[1])); print(max(1, round(r['request_throughput'] * r['mean_e2el_ms'] / 1000)))" "$work/probe-$load.json")
        start fcfs
        run "base-$load" "base-$load.json" --request-rate inf --max-concurrency "$conc"
        base_tpot=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['median_tpot_ms'])" "$work/base-$load.json")
        tpot_slo=$($PY -c "print(round(1.5 * $base_tpot, 3))")
        echo "slo.sh: load $load: the mix runs at $conc in flight; the base model at $conc: TPOT ${base_tpot} ms: TPOT SLO ${tpot_slo} ms" >&2
    fi
    echo "$load $tpot_slo" >> "$work/slos"
    for policy in fcfs slo; do
        start "$policy"
        sloarg=()
        [ "$SEND_SLO" = 1 ] && sloarg=(--extra-body "{\"slo\": {\"ttft_ms\": $TTFT_MS, \"tpot_ms\": $tpot_slo}}")
        run "$policy-$load" "$policy-$load.json" --lora-modules "${bench_mods[@]}" --popularity trace \
            --request-rate "$rate" --goodput "ttft:$TTFT_MS" "tpot:$tpot_slo" --per-rank "${sloarg[@]}"
        echo "slo.sh: $policy at $load: $($PY -c "import json,sys; r=json.load(open(sys.argv[1])); a=r['slo_attainment']; print('attainment', a['all'], '(TTFT', a.get('ttft'), 'TPOT', str(a.get('tpot')) + ')', 'p99 TTFT', r.get('p99_ttft_ms'), 'p99 TPOT', r.get('p99_tpot_ms'))" "$work/$policy-$load.json")" >&2
    done
done
stop

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out="bench/results/slo-$stamp.json"
$PY - "$work" "$out" "$LOADS" "$cap" "$SLO_BASE" "$TTFT_MS" "$N" "$THREADS" <<'PYEOF'
import json, os, sys
work, out, loads, cap, slo_base, ttft_ms, n, threads = sys.argv[1:9]
slos = {float(a): float(b) for a, b in (l.split() for l in open(os.path.join(work, "slos")))}
rows = []
for load in loads.split():
    for policy in ("fcfs", "slo"):
        r = json.load(open(os.path.join(work, f"{policy}-{load}.json")))
        sa = r.get("slo_attainment") or {}
        rows.append({"policy": policy, "load": float(load), "slo_attainment": sa.get("all"),
                     "ttft_attainment": sa.get("ttft"), "tpot_attainment": sa.get("tpot"),
                     "p99_ttft_ms": r.get("p99_ttft_ms"), "p99_tpot_ms": r.get("p99_tpot_ms"),
                     "tpot_slo_ms": slos[float(load)], "request_throughput": r.get("request_throughput"),
                     "failed": r.get("failed", 0)})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
import subprocess
def git(*a):
    try: return subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    except OSError: return ""
commit = git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
res = {"benchmark": "slo", "cpu": cpu, "commit": commit or None, "threads": int(threads), "requests_carry_slo": os.environ.get("SEND_SLO", "1") == "1",
       "model": "llama ~50M (512 hidden, 8 layers, inter 1408, vocab 32000), BF16",
       "adapters": "16, ranks 8/16/32/64 in turn, all 7 projections, BF16; popularity: maf-popularity-128 top 16",
       "capacity_rps": float(cap), "tpot_slo": f"1.5 x the base model's median TPOT ({slo_base})",
       "ttft_slo_ms": float(ttft_ms), "requests_per_run": int(n), "rows": rows}
json.dump(res, open(out, "w"), indent=2)
# the SVG: attainment against load, one line per policy
W, H, L, B = 480, 300, 50, 40
xs = sorted({r["load"] for r in rows})
def px(x): return L + (x - xs[0]) / max(xs[-1] - xs[0], 1e-9) * (W - L - 20)
def py(y): return H - B - y * (H - B - 20)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<line x1="{L}" y1="{py(0)}" x2="{W-20}" y2="{py(0)}" stroke="black"/>',
       f'<line x1="{L}" y1="{py(0)}" x2="{L}" y2="{py(1)}" stroke="black"/>']
for y in (0, 0.5, 0.95, 1):
    svg.append(f'<text x="{L-5}" y="{py(y)+4}" text-anchor="end">{y:g}</text>')
    svg.append(f'<line x1="{L}" y1="{py(y)}" x2="{W-20}" y2="{py(y)}" stroke="#ddd"/>')
for x in xs:
    svg.append(f'<text x="{px(x)}" y="{py(0)+15}" text-anchor="middle">{x:g}</text>')
svg.append(f'<text x="{(L+W-20)/2}" y="{H-5}" text-anchor="middle">load (fraction of capacity)</text>')
svg.append(f'<text x="12" y="{py(0.5)}" transform="rotate(-90 12 {py(0.5)})" text-anchor="middle">SLO attainment</text>')
for policy, color in (("fcfs", "#d62728"), ("slo", "#1f77b4")):
    pts = [(px(r["load"]), py(r["slo_attainment"] or 0)) for r in rows if r["policy"] == policy]
    svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}"/>')
    for a, b in pts:
        svg.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')
    svg.append(f'<text x="{W-25}" y="{pts[-1][1]-6:.1f}" text-anchor="end" fill="{color}">{policy}</text>')
svg.append("</svg>")
open(out[:-5] + ".svg", "w").write("\n".join(svg))
for r in rows:
    print(f"{r['policy']:5s} load {r['load']:.2f}: attainment {r['slo_attainment']}, p99 TTFT {r['p99_ttft_ms']} ms, "
          f"p99 TPOT {r['p99_tpot_ms']} ms")
print(out)
PYEOF
bench_stamp "$out"
