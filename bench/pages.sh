#!/usr/bin/env bash
# bench/pages.sh: the CPU backend's weights read into 2 MiB transparent huge pages (the
# default where the kernel offers them: --no-mmap) against used in place in the file's
# mapping (--mmap: the page cache, 4 KiB pages), side by side in one run, alternating within
# each repetition (the order flips every repetition), on the ~200M Llama of bench/forward.sh:
#   - decode at batch 1 (the weights streamed from memory once per token),
#   - decode at batch 8 on 8 distinct rank-16 adapters (BF16), the base in either memory,
#   - prefill of PROMPT tokens (compute-bound: the copy should neither win nor lose here),
#   - start-up: the wall time of a process that loads the model and runs a 1-token request.
# Each configuration's ratio no-mmap / mmap is the median over the repetitions' pairs. The
# JSON lands in bench/results/ with the CPU, its ISA features and the kernel path.
#
#   bench/pages.sh
# Env: BUILD (build), THREADS (2), GEN (128), PROMPT (512), REPS (8), PRECISION (exact)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-128} PROMPT=${PROMPT:-512} REPS=${REPS:-8} PRECISION=${PRECISION:-exact}
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bench_adapters # lora_args: --lora ad0..ad7 (bench/common.sh)
$PY - "$GEN" "$PROMPT" "$work" <<'PYEOF'
import json, random, sys
gen, prompt, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
random.seed(7)
ids = lambda n: [random.randrange(3, 32000) for _ in range(n)]
with open(f"{work}/batch1.jsonl", "w") as f:
    print(json.dumps({"prompt_ids": ids(16), "max_tokens": gen, "ignore_eos": True, "temperature": 0}), file=f)
with open(f"{work}/batch8_8ad.jsonl", "w") as f:
    for i in range(8):
        print(json.dumps({"prompt_ids": ids(16), "max_tokens": gen // 2, "ignore_eos": True, "temperature": 0,
                          "adapter": f"ad{i}"}), file=f)
with open(f"{work}/prefill.jsonl", "w") as f:
    print(json.dumps({"prompt_ids": ids(prompt), "max_tokens": 1}), file=f)
with open(f"{work}/startup.jsonl", "w") as f:
    print(json.dumps({"prompt_ids": ids(4), "max_tokens": 1}), file=f)
PYEOF

results="$work/runs.jsonl"
: > "$results"
now_ms() { date +%s%3N; }
for r in $(seq "$REPS"); do
    modes="mmap no-mmap"
    [ $((r % 2)) = 0 ] && modes="no-mmap mmap"
    for c in batch1 batch8_8ad prefill startup; do
        for m in $modes; do
            extra=()
            [ "$c" = batch8_8ad ] && extra=("${lora_args[@]}" --lora-dtype bf16 --preload-adapters)
            t0=$(now_ms)
            st=$(batch_stats "$BUILD/caraserve" --model "$model" "${extra[@]}" --requests "$work/$c.jsonl" --"$m" \
                --precision "$PRECISION" --max-num-seqs 64)
            t1=$(now_ms)
            echo "{\"rep\": $r, \"config\": \"$c\", \"mode\": \"$m\", \"process_ms\": $((t1 - t0)), \"stats\": $st}" >> "$results"
        done
    done
    echo "rep $r done" >&2
done

out="bench/results/pages-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$THREADS" "$GEN" "$PROMPT" "$PRECISION" <<'PYEOF'
import json, statistics, sys
runs_path, out, threads, gen, prompt, precision = sys.argv[1:7]
runs = [json.loads(l) for l in open(runs_path)]
med = statistics.median
def speed(r):
    s = r["stats"]
    if r["config"] == "prefill":
        return s["prefill_tokens"] / s["busy_ms"] * 1e3
    if r["config"] == "startup":
        return 1e3 / r["process_ms"]  # processes per second: the ratio reads as for the others
    return s["decode_only_tokens"] / s["decode_only_ms"] * 1e3
for r in runs:  # each run's weights are where the mode says
    w = r["stats"]["weights"]
    assert w["memory"] == ("copy" if r["mode"] == "no-mmap" else "mmap"), r
kernels = next(r["stats"]["backend"]["kernels"] for r in runs)
huge = max(r["stats"]["weights"]["huge_page_bytes"] for r in runs)
copied = max(r["stats"]["weights"]["copied_bytes"] for r in runs)
res = {"benchmark": "pages", "model": "llama ~200M (1024 hidden, 12 layers, 16 heads), BF16", "threads": int(threads),
       "gen_tokens": int(gen), "prompt_tokens": int(prompt), "precision": precision, "kernel_path": kernels,
       "copied_bytes": copied, "huge_page_bytes": huge, "configs": {}}
for c in ("batch1", "batch8_8ad", "prefill", "startup"):
    a = {r["rep"]: speed(r) for r in runs if r["config"] == c and r["mode"] == "mmap"}
    b = {r["rep"]: speed(r) for r in runs if r["config"] == c and r["mode"] == "no-mmap"}
    ratios = [b[k] / a[k] for k in sorted(a) if k in b]
    unit = "processes/s" if c == "startup" else "tok/s"
    ent = {"unit": unit, "mmap": {"runs": list(a.values()), "median": med(a.values())},
           "no_mmap": {"runs": list(b.values()), "median": med(b.values())},
           "no_mmap_vs_mmap": {"runs": ratios, "median": med(ratios), "pairs_faster": sum(x > 1 for x in ratios)}}
    if c == "startup":
        ent["process_ms"] = {m: med(r["process_ms"] for r in runs if r["config"] == c and r["mode"] == m)
                             for m in ("mmap", "no-mmap")}
    res["configs"][c] = ent
json.dump(res, open(out, "w"), indent=2)
print(f"kernels {kernels}, precision {precision}; weights copied {copied / 2**20:.0f} MiB, "
      f"{huge / 2**20:.0f} MiB of them in huge pages")
for c, v in res["configs"].items():
    x = v["no_mmap_vs_mmap"]
    print(f"{c}: mmap {v['mmap']['median']:.2f}, no-mmap {v['no_mmap']['median']:.2f} {v['unit']}; no-mmap/mmap "
          f"{x['median']:.3f} ({x['pairs_faster']} of {len(x['runs'])} pairs faster: "
          f"{', '.join(f'{y:.3f}' for y in x['runs'])})")
    if c == "startup":
        print(f"  process wall time: mmap {v['process_ms']['mmap']:.0f} ms, no-mmap {v['process_ms']['no-mmap']:.0f} ms")
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
