#!/usr/bin/env bash
# bench/rollout.sh: the same rollout work three ways against one `caraserve serve` (the ~200M
# BF16 Llama of bench/common.sh, a rank-16 adapter), side by side in one run:
#   - one POST /v1/rollout: 32 groups x n=8 (each group's samples share its prompt's KV);
#   - 256 POST /v1/completions sent concurrently (the 8 samples of a group as 8 requests with
#     the same prompt, seeds seed..seed+7: what trainers do without a group API);
#   - 32 POST /v1/completions with n=8, concurrently.
# Every request generates GEN tokens (ignore_eos) from a 128-token prompt at temperature 1; every
# run has prompts of its own (no help from an earlier run's prefix cache).
# Output tokens/s of each, repeated REPS times alternating; the JSON lands in bench/results/.
#
#   bench/rollout.sh
# Env: BUILD (build), THREADS (2), GEN (32), REPS (2), CACHE, DTYPE (bf16)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-32} REPS=${REPS:-2}
. bench/common.sh
work=$(mktemp -d)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
a="$CACHE/llama-200m-lora-r16-0"
[ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank 16 \
    --alpha 32 --seed 40 >&2
port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BUILD/caraserve" serve --model "$model" --port "$port" --threads "$THREADS" --kv-cache-bytes 2G \
    --lora-modules "pol=$a" 2> "$work/serve.log" &
pid=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.2; done

ts=$(date -u +%Y%m%dT%H%M%SZ)
$PY - "$port" "$GEN" "$REPS" "$THREADS" "bench/results/rollout-$ts.json" <<'PYEOF'
import http.client, json, random, sys, threading, time
port, gen, reps, threads, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompts = []
def fresh(seed):  # new prompts for every run: nothing comes from an earlier run's prefix cache
    global prompts
    rnd = random.Random(seed)
    prompts = [[1] + [rnd.randrange(3, 32000) for _ in range(127)] for _ in range(32)]

def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    if r.status != 200:
        raise SystemExit(f"{path}: {r.status} {data}")
    return data

def concurrently(bodies, path):
    res = []
    ts = [threading.Thread(target=lambda b=b: res.append(post(path, b))) for b in bodies]
    for t in ts: t.start()
    for t in ts: t.join()
    return res

samp = {"max_tokens": gen, "temperature": 1.0, "ignore_eos": True}
def run_rollout():
    r = post("/v1/rollout", {"adapter": "pol", "sampling": samp,
                             "groups": [{"input_ids": p, "n": 8, "seed": 10 * i} for i, p in enumerate(prompts)]})
    return r["summary"]["output_tokens"]
def run_256():
    rs = concurrently([dict(samp, model="pol", prompt=p, seed=10 * i + k) for i, p in enumerate(prompts) for k in range(8)],
                      "/v1/completions")
    return sum(r["usage"]["completion_tokens"] for r in rs)
def run_n8():
    rs = concurrently([dict(samp, model="pol", prompt=p, n=8, seed=10 * i) for i, p in enumerate(prompts)], "/v1/completions")
    return sum(r["usage"]["completion_tokens"] for r in rs)
def metric(name):
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.request("GET", "/metrics")
    txt = c.getresponse().read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in txt.splitlines() if l.startswith(name))

runs = []
for rep in range(reps):
    for j, (name, fn) in enumerate((("rollout_32x8", run_rollout), ("completions_256", run_256),
                                    ("completions_32xn8", run_n8))):
        fresh(100 * rep + j)
        pf0 = metric("caraserve_prefill_tokens_total")
        t0 = time.perf_counter()
        toks = fn()
        wall = time.perf_counter() - t0
        pf = metric("caraserve_prefill_tokens_total") - pf0
        runs.append({"rep": rep, "kind": name, "tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
                     "prefill_tokens": pf})
        print(json.dumps(runs[-1]), flush=True)
best = {k: max(r["tokens_per_s"] for r in runs if r["kind"] == k) for k in ("rollout_32x8", "completions_256", "completions_32xn8")}
pf = {k: min(r["prefill_tokens"] for r in runs if r["kind"] == k) for k in best}
summary = {"tokens_per_s": {k: round(v, 1) for k, v in best.items()}, "prefill_tokens": pf,
           "rollout_over_256_completions": round(best["rollout_32x8"] / best["completions_256"], 2),
           "rollout_over_32_n8_completions": round(best["rollout_32x8"] / best["completions_32xn8"], 2)}
json.dump({"bench": "rollout", "device": "cpu", "threads": threads, "gen": gen, "prompt_len": 128, "groups": 32, "n": 8,
           "summary": summary, "runs": runs}, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
print("wrote", out)
PYEOF
"$PY" bench/machine.py "bench/results/rollout-$ts.json" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
