# bench/gpu_model.sh: sourced by bench/gpu.sh and bench/coldserve.sh (after BUILD and CACHE):
# gpu_model SHAPE N writes once into $CACHE and names in model a Llama with random BF16
# weights, Llama-2-7B-shaped (hidden 4096, 32 layers, or LAYERS, 32 heads, intermediate 11008,
# vocab 32000) or, with SHAPE tiny, hidden 128, 2 layers, 4 heads, intermediate 256, vocab
# 512; and in adapters its N BF16 adapters on all projections, adapter i of rank 8 << (i % 4)
# (8, 16, 32, 64 in turn). A 7B shape of other than 32 layers is llama-7b-l<LAYERS>-*.
gpu_model() { # shape n
    local -a shape
    local i r a tag=$1
    if [ "$1" = tiny ]; then
        shape=(--hidden 128 --layers 2 --heads 4 --intermediate 256 --vocab 512)
    else
        shape=(--hidden 4096 --layers "${LAYERS:-32}" --heads 32 --intermediate 11008 --vocab 32000)
        [ "${LAYERS:-32}" = 32 ] || tag="$1-l$LAYERS"
    fi
    model="$CACHE/llama-$tag-bf16"
    if [ ! -f "$model/config.json" ]; then
        echo "$(basename "$0"): writing $model (random BF16 weights)" >&2
        "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama "${shape[@]}" --dtype bf16 --seed 7 --max-pos 4096 >&2
    fi
    adapters=()
    for i in $(seq 0 $(($2 - 1))); do
        r=$((8 << (i % 4)))
        a="$CACHE/llama-$tag-lora-r$r-$i"
        [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank "$r" \
            --alpha $((2 * r)) --dtype bf16 --seed $((100 + i)) >&2
        adapters+=("$a")
    done
}
