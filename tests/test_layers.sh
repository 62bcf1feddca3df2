#!/bin/sh
# test_layers.sh: tools/check-layers.sh against this tree (clean) and against small trees that
# use Makefile.am's layer table with one include across the rules each: each must fail and
# name the file, the line and both layers.
src=${CS_SRCDIR:-$(dirname "$0")/..}
check="$src/tools/check-layers.sh"
sh "$check" "$src" || { echo "FAIL: the tree itself breaks its layer rules"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bad() { # FILE INCLUDE WANT: FILE including INCLUDE must be refused with WANT in the message
    rm -rf "$tmp/t" && mkdir -p "$tmp/t" && cp "$src/Makefile.am" "$tmp/t/"
    mkdir -p "$tmp/t/$(dirname "$1")"
    printf '#include "base/common.h"\n#include "%s"\n' "$2" > "$tmp/t/$1"
    if out=$(sh "$check" "$tmp/t" 2>&1); then echo "FAIL: $1 including $2 was accepted"; exit 1; fi
    case $out in *"$1:2: "*"$3"*) echo "ok: $out" ;; *) echo "FAIL: $1 including $2: '$out' lacks '$3'"; exit 1 ;; esac
}
good() { # FILE INCLUDE: accepted
    rm -rf "$tmp/t" && mkdir -p "$tmp/t" && cp "$src/Makefile.am" "$tmp/t/"
    mkdir -p "$tmp/t/$(dirname "$1")"
    printf '#include "%s"\n' "$2" > "$tmp/t/$1"
    sh "$check" "$tmp/t" || { echo "FAIL: $1 including $2 was refused"; exit 1; }
}
bad engine/engine.c bench/bench_metrics.h "the engine layer may not include bench/bench_metrics.h (the bench layer)"
bad bench/caraserve_bench.c engine/engine.h "the bench layer may not include engine/engine.h (the engine layer)"
bad base/rng.c server/server.h "the base layer may not include server/server.h (the server layer)"
bad engine/model.c backend/backend_impl.h "the engine layer may not include backend/backend_impl.h (the backend_impl layer)"
bad text/stop.c lora/peft.h "the text layer may not include lora/peft.h (the lora layer)"
bad rollout_api/rollout.c server/server.h "the rollout layer may not include server/server.h"
good rollout_api/routes.c server/server.h
good cpu_kernels/cpu_device.c backend/backend_impl.h
good engine/model.c backend/backend.h
good bench/micro/kernelbench.c cpu_kernels/kernels.h
echo PASS
