#!/usr/bin/env bash
# bench/weights.sh: what a base-weight update costs, side by side in one run, for the ~200M
# BF16 Llama of bench/common.sh and a 1B-shaped BF16 Llama (hidden 2048, 20 layers, GQA 32/8,
# intermediate 5632, vocab 32000: 1.03B parameters, 2.1 GB):
#   - read: the time to read the checkpoint's bytes into memory (Python, the page cache warm,
#     the same as the update sees), the floor an update from disk cannot beat;
#   - beside / in_place: POST /v1/weights with load=beside and load=in_place, alternating two
#     checkpoints of the same shape, REPS times each: load_ms (request to answer) and pause_ms
#     (how long the engine's iterations stopped for the swap);
#   - the pause a running request sees: a streamed completion runs through one update of each
#     kind; its longest gap between two tokens across the update against its median gap.
# The JSON lands in bench/results/weights-<stamp>.json with the machine's stamp.
#
#   bench/weights.sh
# Env: BUILD (build), THREADS (2), REPS (3), CACHE, SKIP_1B=1 (the 200M model only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPS=${REPS:-3}
. bench/common.sh
work=$(mktemp -d)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
big="$CACHE/llama-1b-bf16"
mk_big() { # $1: out dir, $2: seed
    [ -f "$1/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$1" --arch llama --hidden 2048 --layers 20 \
        --heads 32 --kv-heads 8 --intermediate 5632 --vocab 32000 --dtype bf16 --seed "$2" --tokenizer "$CACHE/spm-32k" >&2
}
models=("200m:$model")
[ -f "$CACHE/llama-200m-bf16-b/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$CACHE/llama-200m-bf16-b" \
    --arch llama --hidden 1024 --layers 12 --heads 16 --intermediate 2816 --vocab 32000 --dtype bf16 --seed 2 \
    --tokenizer "$CACHE/spm-32k" >&2
if [ -z "${SKIP_1B:-}" ]; then
    mk_big "$big" 1
    mk_big "$big-b" 2
    models+=("1b:$big")
fi
ts=$(date -u +%Y%m%dT%H%M%SZ)
: > "$work/results.jsonl"
for spec in "${models[@]}"; do
    name=${spec%%:*} dir=${spec#*:}
    port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # the server reads both checkpoints through --lora-root
    "$BUILD/caraserve" serve --model "$dir" --port "$port" --threads "$THREADS" --kv-cache-bytes 512M \
        --lora-root "$(realpath "$dir")" --lora-root "$(realpath "$dir-b")" 2> "$work/serve-$name.log" &
    pid=$!
    for _ in $(seq 1200); do grep -qs "caraserve: ready" "$work/serve-$name.log" && break; sleep 0.2; done
    $PY - "$port" "$name" "$(realpath "$dir")" "$(realpath "$dir-b")" "$REPS" >> "$work/results.jsonl" <<'PYEOF'
import http.client, json, os, statistics, sys, threading, time
port, name, a, b, reps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])


def call(method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read() or b"null")
    if r.status != 200:
        raise SystemExit(f"{method} {path}: {r.status} {out}")
    return out


def read_ms(d):
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")]
    n = sum(os.path.getsize(f) for f in files)
    buf = bytearray(max(os.path.getsize(f) for f in files))
    for _ in range(2):  # the first warms the page cache; the second is timed
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(buf)
        dt = (time.perf_counter() - t0) * 1000
    return n, dt


nbytes, rd = read_ms(b)
read_ms(a)
res = {"model": name, "bytes": nbytes, "read_ms": rd, "beside": [], "in_place": []}
src = [b, a]
k = 0
for _ in range(reps):
    for load in ("beside", "in_place"):
        r = call("POST", "/v1/weights", {"path": src[k % 2], "load": load})
        k += 1
        if r["load"] != load:
            raise SystemExit(f"asked {load}, got {r}")
        res[load].append({"load_ms": r["load_ms"], "pause_ms": r["pause_ms"]})


def streamed_gaps(load):
    """a streamed completion; the update once it has 8 tokens: its gaps (ms) before and across"""
    times, started = [], threading.Event()

    def run():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/completions", json.dumps({"prompt": [1] + list(range(100, 164)), "max_tokens": 64,
                                                         "temperature": 0, "stream": True, "ignore_eos": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                if len(times) == 8:
                    started.set()
    th = threading.Thread(target=run)
    th.start()
    started.wait(600)
    global k
    t0 = time.perf_counter()
    call("POST", "/v1/weights", {"path": src[k % 2], "load": load})
    t1 = time.perf_counter()
    k += 1
    th.join()
    gaps = [(y - x) * 1000 for x, y in zip(times, times[1:])]
    across = [(y - x) * 1000 for x, y in zip(times, times[1:]) if y >= t0 and x <= t1]
    return {"median_gap_ms": statistics.median(gaps), "max_gap_across_update_ms": max(across or [0.0]),
            "update_ms": (t1 - t0) * 1000}


res["stream_beside"] = streamed_gaps("beside")
res["stream_in_place"] = streamed_gaps("in_place")
for load in ("beside", "in_place"):
    res[load + "_median_load_ms"] = statistics.median(x["load_ms"] for x in res[load])
    res[load + "_median_pause_ms"] = statistics.median(x["pause_ms"] for x in res[load])
    res[load + "_load_over_read"] = res[load + "_median_load_ms"] / res["read_ms"]
print(json.dumps(res))
PYEOF
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
done
out="bench/results/weights-$ts.json"
$PY - "$work/results.jsonl" "$out" "$THREADS" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"bench": "weights", "threads": int(sys.argv[3]), "models": rows}, open(sys.argv[2], "w"), indent=1)
for r in rows:
    print(f"{r['model']}: {r['bytes'] / 1e9:.2f} GB, read {r['read_ms']:.0f} ms; beside {r['beside_median_load_ms']:.0f} ms "
          f"(x{r['beside_load_over_read']:.2f} of the read, pause {r['beside_median_pause_ms']:.1f} ms); in place "
          f"{r['in_place_median_load_ms']:.0f} ms (pause {r['in_place_median_pause_ms']:.0f} ms); a streamed request's "
          f"longest gap across the update: beside {r['stream_beside']['max_gap_across_update_ms']:.0f} ms, in place "
          f"{r['stream_in_place']['max_gap_across_update_ms']:.0f} ms (median gap {r['stream_beside']['median_gap_ms']:.0f} ms)")
PYEOF
bench_stamp "$out"
echo "$out"
