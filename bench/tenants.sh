#!/usr/bin/env bash
# bench/tenants.sh: many tenants. NAD (10,000) PEFT adapters of ranks 8/16/32/64 in one
# directory, requests following CaraServe's measured popularity scaled to NAD adapters, a host
# cache (--max-cpu-loras) of CPU_LORAS (512) adapters: what serving every tenant from disk costs
# the popular ones, and what registering them all costs the server.
#
# Model and adapters (written once into $CACHE, bench/common.sh's cache dir): a ~20M Llama
# (caraserve-mkmodel: hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 704, vocab
# 32000, BF16) and $CACHE/tenants-v1-llama-20m-$NAD/adapters/t00000 ... t<NAD-1>: adapter i
# has rank 8, 16, 32, 64 for i mod 4 = 0..3 (so every popularity band has all four), alpha 2r,
# targets q_proj and v_proj, BF16: 64 KiB to 448 KiB each, ~2.1 GB for 10,000. They are
# written by bench/tenants.py (numpy: a seeded pool of N(0, 0.02) BF16 values, each tensor a
# slice of it) exactly as `caraserve-mkmodel adapter --targets q,v --dtype bf16` writes them:
# each run checks one against caraserve-mkmodel's (adapter_config.json byte for byte, the
# safetensors header's names, dtypes, shapes and offsets).
#
# Popularity: tests/data/bench/maf-popularity-512.csv (or ../shared/workloads/ beside a
# checkout that has it), scaled to NAD adapters over the rank fraction: with the file's shares
# sorted, C(x) = the share of its top fraction x of adapters (linear between its 512 points);
# adapter i (t00000 the most popular) gets C((i+1)/NAD) - C(i/NAD), i.e. each of the 512 shares
# spread evenly over NAD/512 adapters in a row. CaraServe's 128/256/512-adapter files lie on one
# such curve (top 10% of adapters: 70/72/73% of requests), so the top 1% of 10,000 adapters get
# 19%, the top 10% 73%. The hot set: the HOT most popular adapters, or (HOT=0, the default) the
# fewest most popular ones that get HOT_SHARE (0.5) of the requests: 423 of 10,000.
#
# The schedule: caraserve-bench draws N requests (Poisson at RATE/s, IN prompt and OUT output
# tokens, SEED) over the scaled popularity once (--dry-run --dump-schedule); both runs replay
# it (--dataset-name trace), each on a fresh server with --max-cpu-loras CPU_LORAS:
#   A  only the hot set registered (--lora-modules); the schedule's requests to the other
#      adapters go to a hot adapter of the same rank instead, so A carries the same arrival
#      times, lengths and ranks (the same work) with the hot set alone;
#   B  nothing registered: every adapter resolvable (--lora-root, --lora-resolve on the
#      directory), loaded from disk on its first request and evicted (LRU) by the tail.
# Both first get one unmeasured request per hot adapter, so the hot set starts in host memory.
# A and B run in turn ROUNDS (2) times (A B A B), so that a drift of the machine falls on both;
# the hot set's requests (the same ids in every run) are pooled over the rounds and compared:
# p50/p99 TTFT and TPOT, B over A (each round's too). What B costs the hot set is everything
# the tail brings: its loads from disk, its evictions of hot adapters (in an LRU cache of a few
# hundred, the tail's hundreds of distinct adapters push out the less popular hot ones), and
# batches that mix more distinct adapters.
#
# Also, each on a fresh server:
#   start-up: spawn to the first 200 of /health, the base model alone and with
#     --lora-modules-dir over the NAD adapters (every one registered, none loaded; the files
#     in the page cache);
#   RSS per registered adapter: VmRSS 1 s after start, (modules-dir - base alone) / NAD (two
#     processes differ by ~100 KiB: the figure means something for thousands of adapters);
#   GET /v1/models on the modules-dir server, whole and in pages of 100 (limit, after): ids,
#     bytes, time;
#   first-request latency by tier, SAMPLES (8) of the least popular adapters the schedule never
#     asks for, a 1-token request of IN tokens each: "disk" (its first request), then "host"
#     (after the others' first requests: loaded, in host memory; out of its device slot too
#     when SLOTS < SAMPLES), then "resident" (at once again; on the CPU device, where the
#     weights are used in place, host and resident are the same tier); on the modules-dir
#     server (registered, on disk) and on the last B after its run (resolved from
#     --lora-resolve on the first request);
#   scrape size: bytes of GET /metrics on the idle modules-dir server (NAD registered) and on
#     the last A and B after their runs (per-adapter series bounded by
#     --metrics-max-adapters, default 100), with the server's lora counters (loads, cache
#     hits and misses, resolutions) and a sample of GET /v1/adapters/NAME/stats.
#   C  (in each round, after A) A's requests on a server with all NAD adapters registered
#      (--lora-modules-dir) and resolvable: the same work as A, so C/A is what the presence
#      of thousands of adapters costs the hot set.
# Goals (booleans in "goals"): the hot set's p99 TTFT and p99 TPOT within 10% of A's (pooled),
# in C (registered and resolvable) and in B (resolvable, with the tail's own requests: its
# loads, the evictions they cause, its share of the 2 cores); RSS per registered (not
# resident) adapter < 8 KiB; every scrape < 200 KB.
#
# Writes bench/results/tenants-<UTC time>.json (stamped with the CPU by bench/machine.py) and
# tenants-<UTC time>.png beside it (when matplotlib imports in $PY; else the JSON says so).
#
#   bench/tenants.sh        # the full run: ~12 min on 2 cores (+~1 min to write the adapters once)
#   NAD=300 N=200 CPU_LORAS=64 bench/tenants.sh   # a quick one (~1.5 min)
#   PAIRED_ONLY=1 bench/tenants.sh   # only the paired check below (~3 min)
# Env: BUILD (build), THREADS (2), NAD (10000), HOT (0: by HOT_SHARE), HOT_SHARE (0.5),
#      CPU_LORAS (512), SLOTS (0: --max-loras unset), N (1000), RATE (10), IN (128), OUT (32),
#      SEED (1), ROUNDS (2), SAMPLES (8), DEVICE (cpu), KEEP (0; 1 keeps the work directory:
#      schedules, per-request CSVs, server logs), CACHE (common.sh's). Servers get
#      --kv-cache-bytes 256M (4 KiB a token here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NAD=${NAD:-10000} HOT=${HOT:-0} HOT_SHARE=${HOT_SHARE:-0.5} CPU_LORAS=${CPU_LORAS:-512} SLOTS=${SLOTS:-0}
N=${N:-1000} RATE=${RATE:-10} IN=${IN:-128} OUT=${OUT:-32} SEED=${SEED:-1} SAMPLES=${SAMPLES:-8}
ROUNDS=${ROUNDS:-2} DEVICE=${DEVICE:-cpu} KEEP=${KEEP:-0} HOT_ASKED=$HOT
. bench/common.sh
BENCH="$BUILD/caraserve-bench"
TP=bench/tenants.py
KV=256M   # the KV cache (this model: 4 KiB a token), small so that VmRSS is mostly the rest
work=$(mktemp -d)
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap 'stop; if [ "$KEEP" = 1 ]; then say "kept $work"; else rm -rf "$work"; fi' EXIT
say() { echo "tenants.sh: $*" >&2; }

help=$("$BUILD/caraserve" serve --help 2>&1 || true)
for f in --lora-resolve --lora-modules-dir --max-cpu-loras; do
    grep -q -e "$f" <<< "$help" || { say "$BUILD/caraserve serve has no $f"; exit 2; }
done

popfile=tests/data/bench/maf-popularity-512.csv
[ -f "$popfile" ] || popfile=../shared/workloads/maf-popularity-512.csv
[ -f "$popfile" ] || { say "no maf-popularity-512.csv in tests/data/bench or ../shared/workloads"; exit 2; }

# the model and the adapters, once
tmodel="$CACHE/llama-20m-bf16"
[ -f "$tmodel/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$tmodel" --arch llama --hidden 256 --layers 4 \
    --heads 4 --kv-heads 2 --intermediate 704 --vocab 32000 --dtype bf16 --seed 3 --tokenizer "$CACHE/spm-32k" >&2
gen="$CACHE/tenants-v1-llama-20m-$NAD"
ads="$gen/adapters"
"$BUILD/caraserve-mkmodel" adapter --model "$tmodel" --out "$work/mk-r64" --rank 64 --alpha 128 --targets q,v \
    --dtype bf16 >/dev/null
if [ ! -f "$gen/done.json" ]; then
    say "writing $NAD adapters into $ads"
    "$PY" "$TP" adapters "$tmodel" "$ads" "$NAD" --seed 0 > "$work/gen.json"
    "$PY" "$TP" compare "$work/mk-r64" "$ads/t00003" >&2 || { say "the generated adapters differ from caraserve-mkmodel's"; exit 1; }
    mv "$work/gen.json" "$gen/done.json"
fi
[ "$NAD" -lt 4 ] || "$PY" "$TP" compare "$work/mk-r64" "$ads/t00003" > /dev/null ||
    { say "$ads/t00003 differs from caraserve-mkmodel's adapter (remove $gen)"; exit 1; }

# popularity, the hot set, the schedule
"$PY" "$TP" popularity "$popfile" "$NAD" "$work/pop.csv" --hot "$HOT" --hot-share "$HOT_SHARE" > "$work/pop.json"
HOT=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["hot"])' "$work/pop.json")
head -n $((HOT + 1)) "$work/pop.csv" | tail -n +2 | cut -d, -f1 > "$work/hot.txt"
"$BENCH" --popularity-file "$work/pop.csv" --adapter-prefix "" --num-prompts "$N" --request-rate "$RATE" --seed "$SEED" \
    --random-input-len "$IN" --random-output-len "$OUT" --dry-run --dump-schedule "$work/dump.csv" >&2
"$PY" "$TP" schedule "$work/dump.csv" "$work/pop.csv" "$HOT" "$work/sched-B.csv" "$work/sched-A.csv" \
    "$work/tiers.txt" "$SAMPLES" > "$work/sched.json"
say "hot set: $HOT adapters ($(cat "$work/pop.json")); schedule: $(cat "$work/sched.json")"

# serve TAG ARGS...: a fresh server on a free port; sets pid, port, and startup (seconds to /health)
serve() {
    local tag=$1
    shift
    stop
    port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    local extra=()
    [ "$SLOTS" -gt 0 ] && extra+=(--max-loras "$SLOTS")
    local t0=$EPOCHREALTIME
    "$BUILD/caraserve" serve --model "$tmodel" --served-model-name m --port "$port" --threads "$THREADS" \
        --device "$DEVICE" --kv-cache-bytes "$KV" --max-cpu-loras "$CPU_LORAS" ${extra[@]+"${extra[@]}"} "$@" 2> "$work/serve-$tag.log" &
    pid=$!
    startup=$("$PY" "$TP" wait-health "$port" "$t0" 900) || { tail -20 "$work/serve-$tag.log" >&2; exit 1; }
    say "$tag: up in $startup s (pid $pid, port $port)"
}
bench_run() { # TAG ROUND: replay sched-TAG.csv
    local t="$1-$2"
    "$BENCH" --base-url "http://127.0.0.1:$port" --model m --dataset-name trace --dataset-path "$work/sched-$1.csv" \
        --metric-percentiles 50,99 --no-progress --requests-csv "$work/req-$t.csv" --save-result --result-dir "$work" \
        --result-filename "res-$t.json" --label "tenants-$t" > "$work/bench-$t.txt" 2> "$work/bench-$t.err" ||
        { say "caraserve-bench failed ($t):"; tail -20 "$work/bench-$t.txt" "$work/bench-$t.err" >&2; exit 1; }
    say "$t: $(grep -e 'Successful requests' -e 'Failed requests' -e 'P99 TTFT' -e 'P99 TPOT' "$work/bench-$t.txt" |
        tr -s ' ' | paste -sd';')"
}

# start-up and RSS: the base model alone, then every adapter registered from the directory
serve base
sleep 1
"$PY" "$TP" probe "$port" "$pid" "$work/probe_base.json"
s_base=$startup
serve dir --lora-modules-dir "$ads"
s_dir=$startup
sleep 1
"$PY" "$TP" probe "$port" "$pid" "$work/probe_dir.json" --models
"$PY" "$TP" tiers "$port" "$work/tiers.txt" "$IN" > "$work/tiers_dir.json"
stop
echo "{\"base\": $s_base, \"dir\": $s_dir}" > "$work/startup.json"

# paired: registering every adapter against the hot set alone, request by request (the 40 most
# popular, 3 rounds of 150 sequential requests a server); PAIRED_ONLY=1: only this, its JSON
# in bench/results/tenants_paired-*.json
"$PY" "$TP" paired "$BUILD" "$tmodel" "$ads" 40 3 150 "$work/paired.json"
say "paired: $(tr -d '\n' < "$work/paired.json" | tr -s ' ' | cut -c1-300)"
if [ "${PAIRED_ONLY:-0}" = 1 ]; then
    out="bench/results/tenants_paired-$(date -u +%Y%m%dT%H%M%SZ).json"
    cp "$work/paired.json" "$out"
    bench_stamp "$out"
    say "wrote $out"
    exit 0
fi

# A and B in turn, ROUNDS times, each on a fresh server
mods=()
while read -r a; do mods+=("$a=$ads/$a"); done < "$work/hot.txt"
for r in $(seq "$ROUNDS"); do
    # A: the hot set alone
    serve "A$r" --lora-modules "${mods[@]}"
    "$PY" "$TP" warm "$port" "$work/hot.txt" "$IN" >&2
    bench_run A "$r"
    "$PY" "$TP" probe "$port" "$pid" "$work/probe_A.json"
    stop
    # C: A's requests with all NAD adapters registered (--lora-modules-dir) and resolvable:
    # what registering thousands costs the hot set, with the same work
    cp "$work/sched-A.csv" "$work/sched-C.csv"
    serve "C$r" --lora-modules-dir "$ads" --lora-root "$gen" --lora-resolve "$ads"
    "$PY" "$TP" warm "$port" "$work/hot.txt" "$IN" >&2
    bench_run C "$r"
    "$PY" "$TP" probe "$port" "$pid" "$work/probe_C.json"
    stop
    # B: every adapter resolvable, none registered
    serve "B$r" --lora-root "$gen" --lora-resolve "$ads"
    "$PY" "$TP" warm "$port" "$work/hot.txt" "$IN" >&2
    bench_run B "$r"
    if [ "$r" = "$ROUNDS" ]; then
        "$PY" "$TP" tiers "$port" "$work/tiers.txt" "$IN" > "$work/tiers_B.json"
        "$PY" "$TP" probe "$port" "$pid" "$work/probe_B.json" --stats "$(head -1 "$work/hot.txt")" \
            "$(head -1 "$work/tiers.txt")" "$(tail -1 "$work/hot.txt")"
    fi
    stop
done

"$PY" - "$work/params.json" "$work/pop.json" "$gen/done.json" "$popfile" "$NAD" "$HOT" "$HOT_SHARE" "$CPU_LORAS" \
    "$SLOTS" "$N" "$RATE" "$IN" "$OUT" "$SEED" "$THREADS" "$DEVICE" "$HOT_ASKED" "$ROUNDS" "$KV" <<'PYEOF'
import json, sys
(out, pop, done, popfile, nad, hot, share, cpu, slots, n, rate, inp, outp, seed, threads, device, asked, rounds,
 kv) = sys.argv[1:20]
p, d = json.load(open(pop)), json.load(open(done))
json.dump({
    "model": "llama ~20M (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 704, vocab 32000), BF16, "
             f"device {device}",
    "adapters": int(nad), "ranks": [8, 16, 32, 64], "targets": ["q_proj", "v_proj"], "adapter_dtype": "BF16",
    "adapter_bytes_on_disk": d["bytes"], "adapters_generated_s": d["seconds"],
    "popularity_file": popfile,
    "popularity_scaling": "the file's shares sorted, as a curve over the rank fraction (linear between its points); "
                          "adapter i of N gets C((i+1)/N) - C(i/N)",
    "hot": int(hot), "hot_share": p["hot_share"],
    "hot_definition": (f"HOT={asked}: the {hot} most popular adapters" if int(asked) > 0 else
                       f"the fewest most popular adapters that get HOT_SHARE={share} of the requests"),
    "host_cache_adapters": int(cpu), "device_slots": int(slots) or None,
    "requests": int(n), "request_rate": float(rate), "input_tokens": int(inp), "output_tokens": int(outp),
    "seed": int(seed), "threads": int(threads), "rounds": int(rounds), "kv_cache_bytes": kv,
    "run_A": "only the hot set registered (--lora-modules); other adapters' requests sent to a hot adapter of their rank",
    "run_B": "no adapter registered; all resolvable (--lora-root, --lora-resolve DIR), loaded on first request",
    "run_C": "A's requests (the hot set's only) with every adapter registered (--lora-modules-dir) and resolvable",
}, open(out, "w"))
PYEOF
out="bench/results/tenants-$(date -u +%Y%m%dT%H%M%SZ).json"
# the plot: matplotlib (bench/requirements-plot.txt) into the venv when it lacks it
"$PY" -c 'import matplotlib' 2>/dev/null || "$PY" -m pip install -q -r bench/requirements-plot.txt \
    || echo "tenants.sh: matplotlib could not be installed: JSON only" >&2
"$PY" "$TP" report "$work" "$out"
bench_stamp "$out"
say "wrote $out"
cat "$out"
