#!/bin/sh
# tools/check-layers.sh SRCDIR: every #include "dir/file.h" of the layers' sources must point
# to its own layer or one below it (README: Layout). Run by the build (Makefile.am's
# layers.stamp) so a wrong include fails `make`; prints each violation as FILE:LINE.
#   formats  engine/common, rng, safetensors, model_config, backend (the interface)
#   text     text/                       -> formats
#   lora     lora/                       -> formats
#   cpu      cpu_kernels/                -> formats
#   cuda     gpu_kernels/                -> formats
#   engine   engine/model, kv_cache, engine, sampling -> formats, text, lora
#   sched    sched/                      -> formats, text, lora, engine
#   rollout  rollout_api/ but routes.*   -> formats, text, lora, engine, sched
#   server   server/, rollout_api/routes.* -> everything (routes.* are the rollout API's HTTP
#            routes: they take server_t and its connections, so they are the server's side)
#   bench    bench/                      -> formats (it talks to servers over HTTP)
#   tools    tools/                      -> formats, lora
# tests/ may include anything.
srcdir=${1:-.}
cd "$srcdir" || exit 2
layer_of() {
    case $1 in
    engine/common.* | engine/rng.* | engine/safetensors.* | engine/model_config.* | engine/backend.*) echo formats ;;
    engine/*) echo engine ;;
    text/*) echo text ;;
    lora/*) echo lora ;;
    cpu_kernels/*) echo cpu ;;
    gpu_kernels/*) echo cuda ;;
    sched/*) echo sched ;;
    rollout_api/routes.*) echo server ;;
    rollout_api/*) echo rollout ;;
    server/*) echo server ;;
    bench/*) echo bench ;;
    tools/*) echo tools ;;
    *) echo other ;;
    esac
}
allowed() { # layer -> the layers it may include
    case $1 in
    formats) echo "formats" ;;
    text | lora | cpu | cuda) echo "formats $1" ;;
    engine) echo "formats text lora engine" ;;
    sched) echo "formats text lora engine sched" ;;
    rollout) echo "formats text lora engine sched rollout" ;;
    server) echo "formats text lora cpu cuda engine sched rollout server" ;;
    bench) echo "formats bench" ;;
    tools) echo "formats lora tools" ;;
    *) echo "" ;;
    esac
}
bad=0
for f in engine/*.[ch] text/*.[ch] lora/*.[ch] cpu_kernels/*.[ch] gpu_kernels/*.[ch] gpu_kernels/*.cc gpu_kernels/*.cu \
    gpu_kernels/*.cuh sched/*.[ch] \
    rollout_api/*.[ch] server/*.[ch] bench/*.[ch] tools/*.[ch]; do
    [ -f "$f" ] || continue
    from=$(layer_of "$f")
    ok=$(allowed "$from")
    grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[a-z_]*/[A-Za-z0-9_]*\.h"' "$f" | while IFS= read -r line; do
        inc=$(printf '%s\n' "$line" | sed 's/.*"\(.*\)".*/\1/')
        to=$(layer_of "$inc")
        case " $ok " in
        *" $to "*) ;;
        *) echo "$f:${line%%:*}: the $from layer may not include $inc (the $to layer); see tools/check-layers.sh"; echo x ;;
        esac
    done
done | { out=$(cat); [ -z "$out" ] && exit 0; printf '%s\n' "$out" | grep -v '^x$' >&2; exit 1; }
