#!/usr/bin/env bash
# bench/grpo_full.sh: full-parameter GRPO against a running caraserve, on the demo model
# (SmolLM2-135M-Instruct, F32): rollout_api/examples/grpo_full.py trains every weight, saves
# the model each step and loads it into the server through /update_weights_from_disk. Each
# step's record: the reward, the base version the rollout ran on, the largest |server logprob -
# trainer logprob| over the sampled tokens, and the update's time (load beside or in place).
# The JSON lands in bench/results/grpo_full-<stamp>.json with the machine's stamp.
#
#   bench/grpo_full.sh
# Env: BUILD (build), THREADS (2), STEPS (20), MODEL (CS_DEMO_MODEL, else demo/smollm2-135m-instruct)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build} THREADS=${THREADS:-2} STEPS=${STEPS:-20}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
MODEL=${MODEL:-${CS_DEMO_MODEL:-demo/smollm2-135m-instruct}}
[ -f "$MODEL/config.json" ] || { echo "bench/grpo_full.sh: no model at $MODEL (./quickstart demo writes it)" >&2; exit 1; }
work=$(mktemp -d)
trap 'kill $srv 2>/dev/null || true; rm -rf "$work"' EXIT
mkdir "$work/ckpt"
port=$((20000 + RANDOM % 20000))
"$BUILD/caraserve" serve --model "$MODEL" --port "$port" --threads "$THREADS" --lora-root "$work/ckpt" \
    --kv-cache-bytes 256M 2> "$work/server.log" &
srv=$!
for _ in $(seq 600); do grep -q "caraserve: ready" "$work/server.log" && break; sleep 0.2; done
grep -q "caraserve: ready" "$work/server.log" || { cat "$work/server.log" >&2; exit 1; }
out="bench/results/grpo_full-$(date -u +%Y%m%dT%H%M%SZ).json"
"$PY" rollout_api/examples/grpo_full.py --server "http://127.0.0.1:$port" --model "$MODEL" --save-root "$work/ckpt" \
    --steps "$STEPS" --sglang --json-out "$work/steps.json"
"$PY" - "$work/steps.json" "$out" "$MODEL" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
st = d["steps"]
k = max(1, len(st) // 4)
first, last = sum(s["reward"] for s in st[:k]) / k, sum(s["reward"] for s in st[-k:]) / k
d["summary"] = {"model": sys.argv[3], "steps": len(st), "max_abs_logprob_diff": max(s["max_abs_logprob_diff"] for s in st),
                "reward_first_quarter": first, "reward_last_quarter": last, "reward_rose": last > first,
                "update_ms_median": sorted(s["update_ms"] for s in st)[len(st) // 2],
                "update_loads": sorted({s["update_load"] for s in st})}
json.dump(d, open(sys.argv[2], "w"), indent=1)
print(json.dumps(d["summary"]))
PYEOF
"$PY" bench/machine.py "$out" "$BUILD/caraserve" || echo "bench/grpo_full.sh: $out not stamped" >&2
echo "$out"
