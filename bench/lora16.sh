# bench/lora16.sh: sourced by bench/slo.sh and bench/router.sh (after bench/common.sh and
# their $work): the ~50M Llama they serve (hidden 512, 8 layers, BF16) with its 16 adapters,
# ranks 8, 16, 32, 64 in turn on all 7 projections, written once into $CACHE; mods (NAME=DIR
# for --lora-modules) and bench_mods (NAME:RANK:WEIGHT for caraserve-bench: the popularity of
# the trace's first 16 adapters); free_port and wait_health.
model="$CACHE/llama-50m-bf16"
[ -f "$model/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama --hidden 512 --layers 8 \
    --heads 8 --intermediate 1408 --vocab 32000 --dtype bf16 --seed 2 --tokenizer "$CACHE/spm-32k" >&2
mods=() bench_mods=()
tail -n +2 tests/data/bench/maf-popularity-128.csv | head -16 > "$work/top16"
for i in $(seq 0 15); do
    r=$((8 << (i % 4)))
    a="$CACHE/llama-50m-lora-r$r-$i"
    [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank "$r" \
        --alpha $((2 * r)) --seed $((200 + i)) --dtype bf16 >&2
    mods+=("a$i=$a")
    w=$(sed -n "$((i + 1))p" "$work/top16" | cut -d, -f2)
    bench_mods+=("a$i:$r:$w")
done

free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() { # port
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "$(basename "$0"): nothing answers /health on port $1" >&2; return 1
}
