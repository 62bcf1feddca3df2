"""bench/machine.py: stamp a benchmark's JSON with the machine it ran on, so figures from
different CPUs are never mixed: the CPU's model name, its ISA features, the kernel paths
caraserve picks there (exact and --precision bf16, from `caraserve version`, with the
CS_NO_* switches of the environment applied) and those switches. Keys the benchmark wrote
itself (e.g. "kernel_path" of the precision it ran) are kept; the rest go in at the top.

    python3 bench/machine.py RESULT.json BUILD/caraserve
"""
import json
import os
import subprocess
import sys

SWITCHES = ("CS_NO_AVX512", "CS_NO_AVX2", "CS_NO_AMX", "CS_NO_DPBF16", "CS_NO_VNNI", "CS_NO_QPACK", "CS_NO_PACKED", "CS_NO_TILE", "CS_NO_SPLIT",
            "CS_AMX_TERMS", "CS_GEMV_STREAMS")


def machine(caraserve):
    out = subprocess.run([caraserve, "version"], capture_output=True, text=True).stdout
    m = {"cpu": "?", "isa": [], "kernel_path": "?", "kernel_path_bf16": "?"}
    for line in out.splitlines():
        if line.startswith("cpu: "):
            name, _, isa = line[5:].rpartition(" (")
            m["cpu"] = name
            m["isa"] = [f for f in isa.rstrip(")").split() if f != "no"]
        elif line.startswith("kernels: "):
            parts = [p.strip() for p in line[9:].split(",")]
            m["kernel_path"] = parts[0].split(" ")[0]
            if len(parts) > 1:
                m["kernel_path_bf16"] = parts[1].split(" ")[0]
    m["switches"] = {k: os.environ[k] for k in SWITCHES if k in os.environ}
    return m


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: machine.py RESULT.json CARASERVE")
    path, caraserve = sys.argv[1:]
    with open(path) as f:
        res = json.load(f)
    m = machine(caraserve)
    if isinstance(res, dict):
        for k, v in m.items():
            res.setdefault(k, v)
        res["machine"] = m
    else:
        res = {"runs": res, "machine": m, **{k: v for k, v in m.items()}}
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
