#!/usr/bin/env bash
# tools/gpu-host.sh: the checks that need an NVIDIA GPU (the CUDA backend, the cold start), in
# one run on a GPU host that has the CUDA driver, cuBLAS and python3 with torch +
# transformers + peft, but not our libraries (the device tool's hosts). Two halves:
#
#   tools/gpu-host.sh pack        # here, after a build with CUDA (build/, or BUILD=DIR): the
#                                 # programs and the shared libraries a GPU host lacks (all but
#                                 # the C library, libstdc++ and CUDA's) into
#                                 # gpu-carry/bundle.tar.xz (keep gpu-carry/ out of git)
#   OUT=DIR tools/gpu-host.sh     # there, from the source root, with gpu-carry/ carried
#
# Steps (STEPS, in this order): ops (test_backend_ops, every op CUDA against the references),
# emu (tests/test_cuda_emu.py on the GPU against the CPU backend), ref (tests/test_gpu_ref.py:
# BF16 against transformers + peft on the same GPU), gpu (bench/gpu.sh, the 7B-shaped model),
# cold (bench/coldstart.sh DEVICE=cuda), serve (bench/coldserve.sh DEVICE=cuda: 128 adapters on
# CaraServe's popularity, cpu-assist against wait, through caraserve-bench). The 7B-shaped model and its adapters are written in
# the background from the start (one process for the model, the adapters in parallel), so the
# tests overlap them. Every step's output goes to $OUT/all.log with its exit status and time;
# the benches' JSON to $OUT and bench/results/.
# Env: OUT (/tmp/gpu-out), STEPS, CACHE (/tmp/cs-cache), REPS (gpu.sh, 1), COLD_REPS (3),
# THREADS (16), STEP_TIMEOUT (240 seconds each)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${1:-}" = pack ]; then
    set -eo pipefail
    BUILD=${BUILD:-build}
    st=$(mktemp -d)
    trap 'rm -rf "$st"' EXIT
    mkdir -p "$st/g/bin" "$st/g/lib" gpu-carry
    ldd "$BUILD/caraserve" 2>/dev/null | grep -q libcudart || \
        { echo "gpu-host.sh pack: $BUILD/caraserve has no CUDA backend (configure --with-cuda)" >&2; exit 1; }
    for p in caraserve caraserve-mkmodel caraserve-bench tests/test_backend_ops tests/test_gpu bench/gpubench; do
        f=$BUILD/$p
        [ -x "$f" ] || { echo "gpu-host.sh pack: $f missing: build with CUDA first" >&2; exit 1; }
        cp -L "$f" "$st/g/bin/"
        ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
            case $name in
            libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
            libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libnvidia*) ;;  # the host's own
            *) cp -Ln "$path" "$st/g/lib/$name" ;;
            esac
        done
    done
    tar -C "$st" -cJf gpu-carry/bundle.tar.xz g
    echo "gpu-carry/bundle.tar.xz: $(ls "$st/g/bin" | wc -l) programs, $(ls "$st/g/lib" | wc -l) libraries, $(du -h gpu-carry/bundle.tar.xz | cut -f1)"
    exit 0
fi
OUT=${OUT:-/tmp/gpu-out} STEPS=${STEPS:-"ops emu ref gpu cold serve"} CACHE=${CACHE:-/tmp/cs-cache}
REPS=${REPS:-1} COLD_REPS=${COLD_REPS:-3} THREADS=${THREADS:-16} STEP_TIMEOUT=${STEP_TIMEOUT:-240}
mkdir -p "$OUT" "$CACHE" bench/results
log=$OUT/all.log
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$log"; }

G=/tmp/cs-gpu
rm -rf "$G" && mkdir -p "$G" && tar -C "$G" -xJf gpu-carry/bundle.tar.xz || { say "no gpu-carry/bundle.tar.xz"; exit 1; }
# our libraries only for our programs (wrappers below), not for the host's python
libs=$G/g/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null); do
    { [ -e "$d/libcublas.so.13" ] || [ -e "$d/libcudart.so.13" ]; } && libs="$libs:$d"
done
if LD_LIBRARY_PATH=$libs ldd "$G/g/bin/caraserve" | grep -q 'not found'; then
    d=$(find /opt /usr -xdev -name 'libcublas.so.13' -printf '%h\n' 2>/dev/null | head -1)
    [ -n "$d" ] && libs="$libs:$d"
fi
B=$G/build
mkdir -p "$B/tests" "$B/bench"
for p in caraserve caraserve-mkmodel caraserve-bench tests/test_backend_ops tests/test_gpu bench/gpubench; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
        "$libs" "$G/g/bin/$(basename "$p")" > "$B/$p"
    chmod +x "$B/$p"
done
export CS_BUILDDIR=$B CS_SRCDIR=$PWD PYTHON=python3 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CACHE BUILD=$B

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nproc; lscpu | grep 'Model name'
    python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, torch.cuda.get_device_name(0))'
    echo "our programs' libraries: $libs"
    LD_LIBRARY_PATH=$libs ldd "$G/g/bin/caraserve" | grep -E 'cublas|cudart|not found'
} >> "$log" 2>&1

# the 7B-shaped model (bench/gpu.sh's path; bench/coldstart.sh's is a link to it) and the
# adapters both benches use, with the arguments they would use themselves
m7=$CACHE/llama-7b-bf16
gen() {
    [ -f "$m7/config.json" ] || "$B/caraserve-mkmodel" model --out "$m7" --arch llama ${GEN_SHAPE:---hidden 4096 --layers 32 \
        --heads 32 --intermediate 11008 --vocab 32000} --dtype bf16 --seed 7 --max-pos 4096 &
    ln -sfn "$m7" "$CACHE/llama-7bshape-l32-bf16"
    while [ ! -f "$m7/config.json" ]; do sleep 0.5; done
    {
        ranks=(8 16 32 64)
        for i in $(seq 0 31); do r=${ranks[$((i % 4))]}; echo "$CACHE/llama-7b-lora-r$r-$i $r $((100 + i))"; done
        for r in 8 32 64 128; do echo "$CACHE/llama-7bshape-l32-lora-r$r $r $r"; done
        echo "$CACHE/llama-7bshape-l32-lora-r8-other 8 99"
    } | xargs -P 12 -L 1 sh -c '[ -f "$2/adapter_config.json" ] || "$0" adapter --model "$1" --out "$2" --rank "$3" \
            --alpha $((2 * $3)) --seed "$4" --dtype bf16' "$B/caraserve-mkmodel" "$m7"
    wait
}
case " $STEPS " in *" gpu "*|*" cold "*|*" serve "*) gen > "$OUT/gen.log" 2>&1 & genpid=$!; say "writing the 7B-shaped model in the background" ;; esac

step() { # name command...: run with a time limit, output into the log
    local name=$1 s rc; shift
    s=$(date +%s)
    say "== $name: $*"
    timeout "$STEP_TIMEOUT" "$@" >> "$log" 2>&1
    rc=$?
    say "== $name: exit $rc in $(( $(date +%s) - s ))s"
    echo "$name $rc $(( $(date +%s) - s ))" >> "$OUT/summary"
    cp bench/results/gpu-*.json bench/results/coldstart-2*.json bench/results/coldserve-2*.json "$OUT/" 2>/dev/null
}

for s in $STEPS; do
    case $s in
    ops) step ops env CS_TEST_REQUIRE_CUDA=1 "$B/tests/test_backend_ops" ;;
    emu) step emu env CS_TEST_CUDA_DEVICE=cuda python3 tests/test_cuda_emu.py ;;
    ref) step ref env CS_TEST_CUDA_DEVICE=cuda python3 tests/test_gpu_ref.py ;;
    gpu|cold|serve)
        if [ -n "${genpid:-}" ]; then say "waiting for the model"; wait "$genpid"; say "model: exit $?"; genpid=; fi
        case $s in
        gpu) step gpu env REPS="$REPS" bench/gpu.sh ;;
        cold) step cold env DEVICE=cuda THREADS="$THREADS" REPS="$COLD_REPS" bench/coldstart.sh ;;
        serve) step serve env DEVICE=cuda THREADS="$THREADS" bench/coldserve.sh ;;
        esac ;;
    *) say "unknown step $s" ;;
    esac
done
say "done"
