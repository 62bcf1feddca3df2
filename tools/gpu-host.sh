#!/usr/bin/env bash
# tools/gpu-host.sh: the checks that need an NVIDIA GPU (the CUDA backend, the cold start), on a
# GPU host that has the CUDA driver, cuBLAS and python3 with torch + transformers + peft, but
# not our libraries (the device tool's hosts). A GPU host is held briefly and starting one takes
# minutes, so the work comes as two prepared runs of under 8 minutes each, correctness first:
#
#   tools/gpu-host.sh pack            # here, after a build with CUDA (build/, or BUILD=DIR): the
#                                     # programs, the shared libraries a GPU host lacks (all but
#                                     # the C library, libstdc++ and CUDA's) and NVIDIA's
#                                     # compute-sanitizer (from .venv's nvidia-cuda-sanitizer-api,
#                                     # tools/cuda-requirements.txt) into gpu-carry/bundle.tar.xz
#                                     # (keep gpu-carry/ out of git; under 64 MiB)
#   RUN=1 OUT=DIR tools/gpu-host.sh   # there, from the source root, with gpu-carry/ carried:
#                                     # correctness (ops eager ref memcheck synccheck: the
#                                     # sanitizers, slowest, take what is left of the budget)
#   RUN=2 OUT=DIR tools/gpu-host.sh   # the measurements (gpu cold)
#   DRY=1 tools/gpu-host.sh           # here, no GPU: both runs' steps on the host emulation of
#                                     # CUDA and the strict test device, from build/ (no bundle),
#                                     # each step timed: the script itself checked end to end
#
# Steps (STEPS overrides RUN's):
#   ops       tests/test_backend_ops_gpu: every op of the CUDA backend on the GPU against the
#             plain references, the cold start's streaming slots and get_signal / wait_add, graphs,
#             the spin deadline (CUDA's default lazy module loading)
#   eager     the same with CUDA_MODULE_LOADING=EAGER
#   memcheck  the same under compute-sanitizer --tool memcheck (out-of-bounds and misaligned
#             accesses, leaks of device memory), the spin-deadline test left out (it traps on
#             purpose: CS_TEST_NO_TRAP=1)
#   synccheck the same under --tool synccheck (barriers and warp syncs not reached by all)
#   ref       tests/test_gpu_ref.py: BF16 against transformers + peft on the same GPU
#   emu       tests/test_cuda_emu.py on the GPU against the CPU backend (not in RUN=1: time)
#   gpu       bench/gpu.sh on a 7B-shaped model of LAYERS layers (4: per-layer figures as at 32)
#   cold      DEVICE=cuda bench/coldstart.sh, the same shapes
#   serve     DEVICE=cuda bench/coldserve.sh (not in RUN=2: time)
# The 7B-shaped model and its adapters are written in the background from the start, so the
# tests overlap them. A step runs for STEP_TIMEOUT at most and not past the run's BUDGET
# seconds (a step with under 20 s left is skipped, said so), so the run ends in time to copy
# its results back. Every step's output goes to $OUT/all.log, its exit status and time to
# $OUT/summary; the benches' JSON to $OUT and bench/results/.
# Env: RUN (1|2; none: every step), DRY, OUT (/tmp/gpu-out), STEPS, BUDGET (450), STEP_TIMEOUT
# (240), LAYERS (4), CACHE (/tmp/cs-cache), REPS (gpu.sh, 1), COLD_REPS (2), THREADS (16),
# BUILD (DRY: build)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# compute-sanitizer's files in an nvidia/cu13 tree (the wheel's layout: bin/ and lib/)
SAN_FILES="bin/compute-sanitizer bin/libsanitizer-collection.so lib/libInterceptorInjectionTarget.so
lib/libTreeLauncherPlaceholder.so lib/libTreeLauncherTargetInjection.so lib/libTreeLauncherTargetUpdatePreloadInjection.so
lib/libsanitizer-collection.so lib/libsanitizer-public.so"
san_tree() { # the nvidia/cu13 directory holding compute-sanitizer, or nothing
    local d
    for d in ${SANITIZER_DIR:-} .venv/lib/python3*/site-packages/nvidia/cu13; do
        [ -x "$d/bin/compute-sanitizer" ] && { echo "$d"; return; }
    done
}

if [ "${1:-}" = pack ]; then
    set -eo pipefail
    BUILD=${BUILD:-build}
    st=$(mktemp -d)
    trap 'rm -rf "$st"' EXIT
    mkdir -p "$st/g/bin" "$st/g/lib" gpu-carry
    ldd "$BUILD/caraserve" 2>/dev/null | grep -q libcudart || \
        { echo "gpu-host.sh pack: $BUILD/caraserve has no CUDA backend (configure --with-cuda)" >&2; exit 1; }
    for p in caraserve caraserve-mkmodel caraserve-bench tests/test_backend_ops_gpu tests/test_gpu bench/gpubench; do
        f=$BUILD/$p
        [ -x "$f" ] || { echo "gpu-host.sh pack: $f missing: build with CUDA first (make all check TESTS=)" >&2; exit 1; }
        cp -L "$f" "$st/g/bin/"
        ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
            case $name in
            libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
            libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libnvidia*) ;;  # the host's own
            *) cp -Ln "$path" "$st/g/lib/$name" ;;
            esac
        done
    done
    san=$(san_tree)
    if [ -n "$san" ]; then
        mkdir -p "$st/g/san/bin" "$st/g/san/lib"
        for f in $SAN_FILES; do [ -e "$san/$f" ] && cp -L "$san/$f" "$st/g/san/$f"; done
    else
        echo "gpu-host.sh pack: no compute-sanitizer (pip install -r tools/cuda-requirements.txt): memcheck and synccheck will be skipped" >&2
    fi
    tar -C "$st" -cJf gpu-carry/bundle.tar.xz g
    size=$(stat -c %s gpu-carry/bundle.tar.xz)
    echo "gpu-carry/bundle.tar.xz: $(ls "$st/g/bin" | wc -l) programs, $(ls "$st/g/lib" | wc -l) libraries," \
         "compute-sanitizer: $([ -n "$san" ] && echo yes || echo no), $((size >> 20)) MiB"
    [ "$size" -lt $((60 << 20)) ] || { echo "gpu-host.sh pack: the bundle is over 60 MiB: the device tool carries 64 in all" >&2; exit 1; }
    exit 0
fi

RUN=${RUN:-} DRY=${DRY:-}
case $RUN in
1) def="ops eager ref memcheck synccheck" ;;
2) def="gpu cold" ;;
*) def="ops eager ref memcheck synccheck gpu cold" ;;
esac
OUT=${OUT:-/tmp/gpu-out} STEPS=${STEPS:-$def} CACHE=${CACHE:-/tmp/cs-cache} BUDGET=${BUDGET:-450}
REPS=${REPS:-1} COLD_REPS=${COLD_REPS:-2} THREADS=${THREADS:-16} STEP_TIMEOUT=${STEP_TIMEOUT:-240} LAYERS=${LAYERS:-4}
mkdir -p "$OUT" "$CACHE" bench/results
log=$OUT/all.log
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$log"; }

if [ -n "$DRY" ]; then # the local build, the emulation: no bundle, no GPU
    B=$(cd "${BUILD:-build}" && pwd)
    PY=python3
    [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
    san=$(san_tree)
    SAN=${san:+$san/bin/compute-sanitizer}
    say "dry run: $B on the host emulation of CUDA and the strict device; compute-sanitizer: ${SAN:-none}"
else
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
    for p in caraserve caraserve-mkmodel caraserve-bench tests/test_backend_ops_gpu tests/test_gpu bench/gpubench; do
        printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
            "$libs" "$G/g/bin/$(basename "$p")" > "$B/$p"
        chmod +x "$B/$p"
    done
    PY=python3
    SAN=
    [ -x "$G/g/san/bin/compute-sanitizer" ] && SAN=$G/g/san/bin/compute-sanitizer
    command -v compute-sanitizer > /dev/null && [ -z "$SAN" ] && SAN=$(command -v compute-sanitizer)
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
        nproc; lscpu | grep 'Model name'
        python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, torch.cuda.get_device_name(0))'
        echo "our programs' libraries: $libs; compute-sanitizer: ${SAN:-none}"
        LD_LIBRARY_PATH=$libs ldd "$G/g/bin/caraserve" | grep -E 'cublas|cudart|not found'
    } >> "$log" 2>&1
fi
export CS_BUILDDIR=$B CS_SRCDIR=$PWD PYTHON=$PY PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CACHE BUILD=$B LAYERS

# the 7B-shaped model of LAYERS layers and the adapters bench/gpu.sh and bench/coldstart.sh use,
# under the names they look for (bench/gpu_model.sh; coldstart's a link to the same model)
m7=$CACHE/llama-7b-l$LAYERS-bf16
gen() {
    [ -f "$m7/config.json" ] || "$B/caraserve-mkmodel" model --out "$m7" --arch llama --hidden 4096 --layers "$LAYERS" \
        --heads 32 --intermediate 11008 --vocab 32000 --dtype bf16 --seed 7 --max-pos 4096 &
    ln -sfn "$m7" "$CACHE/llama-7bshape-l$LAYERS-bf16"
    while [ ! -f "$m7/config.json" ]; do sleep 0.5; done
    {
        ranks=(8 16 32 64)
        for i in $(seq 0 31); do r=${ranks[$((i % 4))]}; echo "$CACHE/llama-7b-l$LAYERS-lora-r$r-$i $r $((100 + i))"; done
        for r in 8 32 64 128; do echo "$CACHE/llama-7bshape-l$LAYERS-lora-r$r $r $r"; done
        echo "$CACHE/llama-7bshape-l$LAYERS-lora-r8-other 8 99"
    } | xargs -P 12 -L 1 sh -c '[ -f "$2/adapter_config.json" ] || "$0" adapter --model "$1" --out "$2" --rank "$3" \
            --alpha $((2 * $3)) --seed "$4" --dtype bf16' "$B/caraserve-mkmodel" "$m7"
    wait
}
genpid=
if [ -z "$DRY" ]; then
    case " $STEPS " in *" gpu "*|*" cold "*|*" serve "*) gen > "$OUT/gen.log" 2>&1 & genpid=$!; say "writing the 7B-shaped model ($LAYERS layers) in the background" ;; esac
fi

: > "$OUT/summary"
step() { # name command...: run within the step's and the run's time, output into the log
    local name=$1 s rc left lim; shift
    left=$(( BUDGET - ($(date +%s) - t0) ))
    lim=$(( STEP_TIMEOUT < left ? STEP_TIMEOUT : left ))
    if [ "$lim" -lt 20 ]; then
        say "== $name: skipped, ${left}s of the run's ${BUDGET}s left"
        echo "$name skipped 0" >> "$OUT/summary"
        return
    fi
    s=$(date +%s)
    say "== $name (at most ${lim}s): $*"
    timeout "$lim" "$@" >> "$log" 2>&1
    rc=$?
    say "== $name: exit $rc in $(( $(date +%s) - s ))s"
    echo "$name $rc $(( $(date +%s) - s ))" >> "$OUT/summary"
    cp bench/results/gpu-*.json bench/results/coldstart-2*.json bench/results/coldserve-2*.json "$OUT/" 2>/dev/null
}
# the ops test on this host: the GPU's, or on a dry run the emulation's (with the CPU variants)
ops_bin=$B/tests/test_backend_ops_gpu
[ -n "$DRY" ] && ops_bin=$B/tests/test_backend_ops
sanitize() { # tool
    if [ -z "$SAN" ]; then
        say "== $1: skipped, no compute-sanitizer carried"
        echo "$1 skipped 0" >> "$OUT/summary"
    elif [ -n "$DRY" ]; then # the carried tool starts; without a GPU it has nothing to check
        step "$1" "$SAN" --version
    else
        step "$1" "$SAN" --tool "$1" --target-processes all --error-exitcode 1 --print-limit 20 \
            env CS_TEST_NO_TRAP=1 CS_TEST_REQUIRE_CUDA=1 "$ops_bin"
    fi
}
emu_env=()
[ -n "$DRY" ] || emu_env=(CS_TEST_CUDA_DEVICE=cuda)

for s in $STEPS; do
    case $s in
    ops) step ops env CS_TEST_REQUIRE_CUDA=1 "$ops_bin" ;;
    eager) step eager env CUDA_MODULE_LOADING=EAGER CS_TEST_REQUIRE_CUDA=1 "$ops_bin" ;;
    memcheck|synccheck) sanitize "$s" ;;
    ref) step ref env ${emu_env[@]+"${emu_env[@]}"} "$PY" tests/test_gpu_ref.py ;;
    emu) step emu env ${emu_env[@]+"${emu_env[@]}"} "$PY" tests/test_cuda_emu.py ;;
    gpu|cold|serve)
        if [ -n "$genpid" ]; then say "waiting for the model"; wait "$genpid"; say "model: exit $?"; genpid=; fi
        if [ -n "$DRY" ]; then # the scripts' own dry runs: a tiny model on the emulator, the strict device
            case $s in
            gpu) step gpu env SHAPE=tiny CS_TEST_DEVICE=cuda-emu REPS=1 bench/gpu.sh ;;
            cold) step cold env DEVICE=strict LAYERS=2 REPS=1 RANKS="8 64" PROMPT=64 THREADS=2 RESULTS="$OUT" \
                bench/coldstart.sh ;;
            serve) say "== serve: no dry run (bench/coldserve.sh needs a GPU or its own simulation)" ;;
            esac
        else
            case $s in
            gpu) step gpu env REPS="$REPS" bench/gpu.sh ;;
            cold) step cold env DEVICE=cuda THREADS="$THREADS" REPS="$COLD_REPS" bench/coldstart.sh ;;
            serve) step serve env DEVICE=cuda THREADS="$THREADS" bench/coldserve.sh ;;
            esac
        fi ;;
    *) say "unknown step $s" ;;
    esac
done
[ -n "$genpid" ] && kill "$genpid" 2>/dev/null
say "done: $(tr '\n' ';' < "$OUT/summary")"
