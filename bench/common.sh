# bench/common.sh: sourced by the bench scripts (run from the source root): the shared
# settings and the ~200M Llama benchmark model (caraserve-mkmodel: hidden 1024, 12 layers,
# 16 heads, intermediate 2816, vocab 32000, the Llama-2 32k tokenizer), written once into
# $CACHE, and its F16 GGUF for llama.cpp when LLAMA_CPP_DIR is set.
BUILD=${BUILD:-build} THREADS=${THREADS:-2}
DTYPE=${DTYPE:-bf16}
CACHE=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/caraserve-bench}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
LLAMA_PY=${LLAMA_PY:-$PY}
model="$CACHE/llama-200m-$DTYPE"
# the machine into a result's JSON: the CPU, its ISA features, the kernel paths (bench/machine.py)
bench_stamp() { if [ -f "$1" ]; then "$PY" bench/machine.py "$1" "$BUILD/caraserve" || echo "bench_stamp: $1 not stamped" >&2; fi; }
mkdir -p "$CACHE" bench/results
# decode_tps STATS [DIGITS]: "N tok/s", the decode-only rate of a `caraserve batch --stats` line
# rounded to DIGITS (2) decimals
decode_tps() {
    "$PY" -c "import json,sys; s=json.loads(sys.argv[1]); print(round(s['decode_only_tokens']/s['decode_only_ms']*1e3,${2:-2}), 'tok/s')" "$1"
}
# batch_stats BIN [ARGS...]: the --stats JSON line of `BIN batch --threads $THREADS --stats ARGS`
# (BIN: a caraserve binary; its output and its other stderr lines dropped)
batch_stats() {
    "$1" batch --threads "$THREADS" --stats "${@:2}" 2>&1 >/dev/null | grep '^{'
}
# bench_adapters [STEM]: lora_args: --lora ad0..ad7, eight rank-16 adapters of $model (all
# targets, F32 as peft saves them), $CACHE/STEM-lora-r16-0..7 (STEM: llama-200m), written once
bench_adapters() {
    lora_args=()
    local i a
    for i in 0 1 2 3 4 5 6 7; do
        a="$CACHE/${1:-llama-200m}-lora-r16-$i"
        [ -f "$a/adapter_config.json" ] || "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$a" --rank 16 \
            --alpha 32 --seed $((40 + i)) >&2
        lora_args+=(--lora "ad$i=$a")
    done
}

if [ ! -f "$model/config.json" ]; then
    tok="$CACHE/spm-32k"
    mkdir -p "$tok"
    xz -dc tests/data/tokenizers/spm-32k/tokenizer.json.xz > "$tok/tokenizer.json"
    cp tests/data/tokenizers/spm-32k/tokenizer_config.json "$tok/"
    "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama --hidden 1024 --layers 12 --heads 16 \
        --intermediate 2816 --vocab 32000 --dtype "$DTYPE" --seed 1 --tokenizer "$tok" >&2
fi

gguf=""
if [ -n "${LLAMA_CPP_DIR:-}" ]; then
    gguf="$CACHE/llama-200m-f16.gguf"
    if [ ! -f "$gguf" ]; then
        PYTHONPATH="$LLAMA_CPP_DIR/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$LLAMA_PY" "$LLAMA_CPP_DIR/convert_hf_to_gguf.py" \
            "$model" --outtype f16 --outfile "$gguf" >&2
    fi
fi
