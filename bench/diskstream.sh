#!/usr/bin/env bash
# bench/diskstream.sh: how soon a request may start on an adapter that is only on disk. The
# registry streams the file in, in layer order, and hands the adapter out once the header
# is read (stream_host: `serve` and `batch` on a GPU or the strict device), against reading
# the whole file first (the CPU backend, and every backend before). A 7B-shaped Llama
# config (32 layers, hidden 4096, intermediate 11008; no weights are needed) with BF16
# adapters of rank 16 and 64 on all 7 projections (80 and 320 MiB); bench/streambench times,
# per mode and rank (modes alternating, each run from a fresh registry with the file's cached
# pages dropped): the adapter handed out, its first, middle and last layer in host memory,
# the load complete. On a GPU the prefill's layer l needs only layer l's LoRA: the request
# starts at "handed" instead of "complete". JSON in bench/results/diskstream-*.json with the
# machine and the file system; on a VM the "disk" may be the host's cache: say so.
#
#   bench/diskstream.sh
# Env: BUILD (build), DIR (where the adapters go: $CACHE), REPS (5), RANKS ("16 64")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPS=${REPS:-5} RANKS=${RANKS:-"16 64"}
. bench/common.sh
DIR=${DIR:-$CACHE}
cfg="$DIR/llama-7bshape-l32-config"
mkdir -p "$cfg"
[ -f "$cfg/config.json" ] || cat > "$cfg/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
 "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
JSON
out="bench/results/diskstream-$(date -u +%Y%m%dT%H%M%SZ).json"
rows=()
for r in $RANKS; do
    a="$DIR/llama-7bshape-l32-lora-r$r"
    [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$cfg" --out "$a" --rank "$r" \
        --alpha $((2 * r)) --seed "$r" --dtype bf16 >&2
    rows+=("$("$BUILD/bench/streambench" --model "$cfg" --adapter "$a" --reps "$REPS")")
done
fs=$(stat -f -c %T "$DIR")
dev=$(df --output=source "$DIR" | tail -1)
$PY - "$out" "$fs" "$dev" "${rows[@]}" <<'PYEOF'
import json, platform, sys
out, fs, dev, *rows = sys.argv[1:]
rows = [json.loads(x) for x in rows]
r = {"what": "an adapter on disk only: handed out / layers in host memory / complete, ms from the first acquire",
     "kernel": platform.release(), "filesystem": fs, "device": dev, "rows": rows}
json.dump(r, open(out, "w"), indent=2)
print(f"{fs} on {dev}")
print(f"{'rank':>4} {'MiB held':>8} | {'mode':6} {'handed':>8} {'layer 0':>8} {'layer 16':>8} {'layer 31':>8} {'complete':>9}")
for x in rows:
    for m in ("whole", "stream"):
        t = x[m]
        print(f"{x['max_rank']:>4} {x['adapter_bytes'] / 2**20:8.0f} | {m:6} {t['handed_ms']:8.1f} {t['layer_first_ms']:8.1f} "
              f"{t['layer_middle_ms']:8.1f} {t['layer_last_ms']:8.1f} {t['complete_ms']:9.1f}")
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
