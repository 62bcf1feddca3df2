#!/usr/bin/env bash
# bench/loadio.sh: how fast the adapter loader (lora/loader_uring.c) brings adapter-sized
# files into memory: O_DIRECT (the default, `--lora-io direct`) into the loader's pool of
# registered, reused buffers; the same into fresh buffers (no pool); the page cache cold (each
# file's cached pages dropped first) and warm (a reload the OS kept in RAM), in one run with
# the modes alternating (bench/loadbench). GB/s and the process's CPU seconds per GB.
# The JSON lands in bench/results/loadio-*.json with the CPU, the kernel, the file system and
# the block device the files were on. On a VM the "disk" may be the host's cache: say so.
#
#   bench/loadio.sh
# Env: BUILD (build), DIR (where the files go: $TMPDIR or /tmp), FILES (8), MIB (64 per file:
#      a 7B-shaped rank-16 adapter in BF16 is ~80 MB), REPS (5), QD (16), CHUNK_KIB (1024)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build} DIR=${DIR:-${TMPDIR:-/tmp}} FILES=${FILES:-8} MIB=${MIB:-64} REPS=${REPS:-5}
QD=${QD:-16} CHUNK_KIB=${CHUNK_KIB:-1024}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p bench/results
work=$(mktemp -d "$DIR/cs_loadio_XXXXXX")
trap 'rm -rf "$work"' EXIT
js=$("$BUILD/bench/loadbench" --dir "$work" --files "$FILES" --mib "$MIB" --reps "$REPS" --qd "$QD" \
    --chunk-kib "$CHUNK_KIB")
fs=$(stat -f -c %T "$work")
dev=$(df --output=source "$work" | tail -1)
out="bench/results/loadio-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$js" "$out" "$fs" "$dev" <<'PYEOF'
import json, os, platform, subprocess, sys
js, out, fs, dev = sys.argv[1:5]
r = json.loads(js)
r["cpu"] = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
r["kernel"] = platform.release()
r["filesystem"] = fs
r["device"] = dev
name = os.path.basename(dev)
model = f"/sys/class/block/{name}/device/model"
r["device_model"] = open(model).read().strip() if os.path.exists(model) else None
try:
    r["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError:
    r["thp"] = None
r["dir"] = "(a temporary directory on the device above)"
json.dump(r, open(out, "w"), indent=2)
print(f"cpu: {r['cpu']}, kernel {r['kernel']}, {fs} on {dev}; {r['files']} files x {r['mib_per_file']} MiB, "
      f"{r['direct_files']} read with O_DIRECT, {r['registered_files']} into registered buffers")
for m in ("direct", "direct_fresh", "buffered_cold", "buffered_warm"):
    print(f"{m:14s} {r[m]['gb_s_median']:7.3f} GB/s  {r[m]['cpu_s_per_gb_median']:.3f} CPU s/GB")
print(f"wrote {out}")
PYEOF
"$PY" bench/machine.py "$out" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
