#!/usr/bin/env bash
# bench/coldstart.sh: time to first token of a request whose adapter is in host memory but
# not on the device (cold: its slot streams in while the request runs), with --cold-start
# cpu-assist (the layers not there yet take their LoRA from host workers) and wait (the
# request waits for the whole slot), against the same adapter already in its slot (cached).
# A 7B-shaped BF16 Llama (hidden 4096, 32 heads, intermediate 11008, vocab 32000; LAYERS of
# them) with BF16 adapters of rank 8, 32, 64 and 128 on all 7 projections; prompts of PROMPT
# random tokens (no prefix hits), one new token; one device slot (--max-loras 1), so a request
# for another adapter in between makes the next one cold again. Per rank and mode one
# `caraserve batch --sequential --timings` runs REPS rounds of [other, cold, cached]; the
# JSON in bench/results/ has the medians per rank:
#   {"rank", "ttft_cpu_assist_ms", "ttft_wait_ms", "ttft_cached_ms"}
#
#   bench/coldstart.sh                   # SIMULATED: the strict test device (CPU kernels
#                                        # behind a copy link of GBPS GB/s), LAYERS=2
#   DEVICE=cuda LAYERS=32 bench/coldstart.sh   # on an NVIDIA GPU: the real thing
# The simulation is a benchmark of the mechanism, not of a GPU: its "device" computes on the
# same two cores as the host workers, so it cannot show the overlap a GPU gives; it is
# labelled "simulated" in its JSON and never stands in for the GPU numbers.
# Env: BUILD (build), THREADS (2), DEVICE (strict|cuda), GBPS (25), LAYERS (2 strict, 32
# cuda), PROMPT (256), REPS (3), RANKS ("8 32 64 128"), ASSIST_THREADS (default of caraserve),
# RESULTS (where the JSON goes: bench/results)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE=${DEVICE:-strict} GBPS=${GBPS:-25} PROMPT=${PROMPT:-256} REPS=${REPS:-3} RANKS=${RANKS:-"8 32 64 128"}
LAYERS=${LAYERS:-$([ "$DEVICE" = cuda ] && echo 32 || echo 2)}
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

m7="$CACHE/llama-7bshape-l$LAYERS-bf16"
[ -f "$m7/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$m7" --arch llama --hidden 4096 --layers "$LAYERS" \
    --heads 32 --intermediate 11008 --vocab 32000 --dtype bf16 --seed 7 >&2
other="$CACHE/llama-7bshape-l$LAYERS-lora-r8-other"
[ -f "$other/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$m7" --out "$other" --rank 8 --alpha 16 \
    --seed 99 --dtype bf16 >&2

envs=()
devflag=(--device "$DEVICE")
if [ "$DEVICE" = strict ]; then
    envs=(CS_TEST_DEVICE=strict "CS_STRICT_GBPS=$GBPS")
    devflag=(--device cpu)
fi
at=()
[ -n "${ASSIST_THREADS:-}" ] && at=(--assist-threads "$ASSIST_THREADS")

results="$work/runs.jsonl"
: > "$results"
for r in $RANKS; do
    a="$CACHE/llama-7bshape-l$LAYERS-lora-r$r"
    [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$m7" --out "$a" --rank "$r" \
        --alpha $((2 * r)) --seed "$r" --dtype bf16 >&2
    $PY - "$PROMPT" "$REPS" "$r" > "$work/req-$r.jsonl" <<'PYEOF'
import json, random, sys
prompt, reps, rank = map(int, sys.argv[1:4])
rng = random.Random(rank)
def req(i, adapter, kind):
    return {"id": f"{kind}-{i}", "prompt_ids": [1] + [rng.randrange(3, 32000) for _ in range(prompt - 1)],
            "max_tokens": 1, "ignore_eos": True, "temperature": 0, "adapter": adapter}
print(json.dumps(req(0, "c", "first")))  # the process's first forward: its one-time costs
for i in range(reps):
    for adapter, kind in (("o", "other"), ("c", "cold"), ("c", "cached")):
        print(json.dumps(req(i, adapter, kind)))
PYEOF
    for mode in cpu-assist wait; do
        env "${envs[@]}" "$BUILD/caraserve" batch --model "$m7" --lora "c=$a" --lora "o=$other" "${devflag[@]}" \
            --requests "$work/req-$r.jsonl" --threads "$THREADS" --sequential --timings --max-loras 1 \
            --preload-adapters --cold-start "$mode" "${at[@]}" --kv-cache-bytes 2G --stats >"$work/out" 2>"$work/err" ||
            { echo "coldstart.sh: rank $r $mode: caraserve batch failed:" >&2; tail -20 "$work/err" >&2; exit 1; }
        $PY - "$r" "$mode" "$work/out" "$work/err" >> "$results" <<'PYEOF'
import json, sys
rank, mode, out, err = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
st = [json.loads(l) for l in open(err) if l.startswith("{")][-1]
for l in map(json.loads, open(out)):
    if "error" in l or any("error" in s for s in l.get("samples", [])):
        sys.exit(f"rank {rank} {mode}: a request failed: {l}")
    print(json.dumps({"rank": rank, "mode": mode, "kind": l["id"].split("-")[0], "ttft_ms": l["ttft_ms"],
                      "cold_start": st["cold_start"], "kernels": st["backend"]["kernels"], "backend": st["backend"]["name"]}))
PYEOF
        echo "rank $r $mode: $(grep "\"rank\": $r, \"mode\": \"$mode\"" "$results" | $PY -c "
import json,sys
rows=[json.loads(l) for l in sys.stdin]
print(', '.join(f\"{x['kind']} {x['ttft_ms']:.1f}\" for x in rows))") ms" >&2
    done
done

out="${RESULTS:-bench/results}/coldstart-$([ "$DEVICE" = strict ] && echo sim- || true)$(date -u +%Y%m%dT%H%M%SZ).json"
gpu=""
[ "$DEVICE" = cuda ] && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
$PY - "$results" "$out" "$DEVICE" "$GBPS" "$LAYERS" "$PROMPT" "$THREADS" "$gpu" <<'PYEOF'
import json, statistics, sys
runs_path, out, device, gbps, layers, prompt, threads, gpu = sys.argv[1:9]
runs = [json.loads(l) for l in open(runs_path)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
med = statistics.median
rows = []
for rank in sorted({r["rank"] for r in runs}):
    def t(mode, kind):
        return [r["ttft_ms"] for r in runs if r["rank"] == rank and r["mode"] == mode and r["kind"] == kind]
    cached = t("cpu-assist", "cached") + t("wait", "cached")
    row = {"rank": rank, "ttft_cpu_assist_ms": med(t("cpu-assist", "cold")), "ttft_wait_ms": med(t("wait", "cold")),
           "ttft_cached_ms": med(cached),
           "runs_ms": {"cpu_assist": t("cpu-assist", "cold"), "wait": t("wait", "cold"), "cached": cached}}
    row["cpu_assist_over_cached"] = row["ttft_cpu_assist_ms"] / row["ttft_cached_ms"]
    row["wait_over_cpu_assist"] = row["ttft_wait_ms"] / row["ttft_cpu_assist_ms"]
    cs = [r["cold_start"] for r in runs if r["rank"] == rank and r["mode"] == "cpu-assist"][-1]
    row["cpu_assist_host_layers"], row["cpu_assist_device_layers"] = cs["host_layers"], cs["device_layers"]
    rows.append(row)
sim = device == "strict"
res = {"benchmark": "coldstart", "simulated": sim,
       "device": (f"strict test device: the CPU kernels behind a simulated {gbps} GB/s copy link (SIMULATED, not a GPU)"
                  if sim else f"{gpu or 'cuda'}"),
       "cpu": cpu, "threads": int(threads), "kernel_path": runs[0]["kernels"] if runs else "?",
       "model": f"llama 7B-shaped (hidden 4096, 32 heads, intermediate 11008, vocab 32000), {layers} layers, BF16",
       "adapters": "BF16, all 7 projections, alpha 2r", "prompt_tokens": int(prompt), "new_tokens": 1,
       "goals": {"cpu_assist_over_cached": "<= 1.10", "wait_over_cpu_assist_rank64": ">= 1.5"},
       "rows": rows}
json.dump(res, open(out, "w"), indent=2)
for r in rows:
    print(f"rank {r['rank']:4d}: cpu-assist {r['ttft_cpu_assist_ms']:.1f} ms, wait {r['ttft_wait_ms']:.1f} ms, cached "
          f"{r['ttft_cached_ms']:.1f} ms (cpu-assist/cached {r['cpu_assist_over_cached']:.3f}, wait/cpu-assist "
          f"{r['wait_over_cpu_assist']:.3f})")
print(out)
PYEOF
bench_stamp "$out"
