#!/usr/bin/env bash
# bench/soak.sh MINUTES: caraserve serve under a long mixed load with faults (bench/soak.py:
# caraserve-bench's streamed completions, completions, chat, rollouts aborted and resumed,
# clients hanging up, adapter loads/unloads and version pushes, reference prompts checked
# every 10 s, RSS/fds/threads/KV sampled every second). Writes bench/results/soak-*.json and
# .svg; exits 1 when the goal (no 5xx, no wrong answer, RSS growth < 5% after warm-up) is missed.
# The model: a small Llama (hidden 256, 4 layers, the 32k SentencePiece tokenizer), adapters of
# rank 8 and 16, written once into $CACHE. KEEP_WORK=DIR keeps the server's and bench's logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
minutes=${1:?usage: bench/soak.sh MINUTES}
BUILD=${BUILD:-build}
CACHE=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/caraserve-bench}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
model=$CACHE/soak-llama-f32
adapters=$CACHE/soak-adapters
if [ ! -f "$model/config.json" ]; then
    tok=$CACHE/spm-32k
    mkdir -p "$tok"
    xz -dc tests/data/tokenizers/spm-32k/tokenizer.json.xz > "$tok/tokenizer.json"
    cp tests/data/tokenizers/spm-32k/tokenizer_config.json "$tok/"
    "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama --hidden 256 --layers 4 --heads 4 \
        --intermediate 688 --vocab 32000 --seed 3 --tokenizer "$tok" >&2
fi
if [ ! -f "$adapters/policy2/adapter_config.json" ]; then
    mk() { "$BUILD/caraserve-mkmodel" adapter --model "$model" --out "$adapters/$1" --rank "$2" --seed "$3" >&2; }
    mk a8 8 1; mk a16 16 2; mk churn0 8 3; mk churn1 32 4; mk policy0 8 5; mk policy1 8 6; mk policy2 8 7
fi
work=${KEEP_WORK:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
"$PY" bench/soak.py --minutes "$minutes" --build "$BUILD" --model "$model" --adapters "$adapters" \
    --chat-template tests/data/chat_templates/llama-2-chat.jinja --work "$work" --results bench/results \
    --threads "${THREADS:-2}" --rate "${RATE:-2}"
"$PY" bench/machine.py "$(ls -t bench/results/soak-*.json | head -1)" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
