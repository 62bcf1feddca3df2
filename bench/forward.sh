#!/usr/bin/env bash
# bench/forward.sh: prefill and decode tokens/s of `caraserve generate` on a ~200M-parameter
# Llama model (caraserve-mkmodel: hidden 1024, 12 layers, 16 heads, intermediate 2816, vocab
# 32000, BF16), and beside it llama.cpp's llama-bench on the same shapes (F16 GGUF converted
# from the same checkpoint) when LLAMA_CPP_DIR points at a llama.cpp build. Measured as
# llama-bench does: prefill = a PROMPT-token prompt (pp512), decode = GEN tokens generated
# from an empty context (tg128), and pg = PROMPT tokens then GEN generated, all tokens over the
# whole time (llama-bench -pg 512,128), where decode attends to the prompt. The JSON names the
# CPU, its ISA features and the kernel path caraserve chose; CS_NO_AVX512=1 (and CS_NO_AMX=1)
# in the environment runs caraserve's AVX2 path on an AVX-512 CPU (llama.cpp keeps what it
# was built for). Beside the exact default, each repetition also times the prefill with
# `--precision bf16` (activations rounded to BF16, F32 sums: vdpbf16ps or AMX with one term).
# Runs alternate between the two so machine noise hits both alike; the JSON lands in
# bench/results/. Quiet the machine first: numbers from a busy one
# are meaningless.
#
#   bench/forward.sh                       # caraserve only
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/forward.sh
# Env: BUILD (build), THREADS (2), PROMPT (512), GEN (128), REPS (3), CACHE (~/.cache/caraserve-bench),
#      LLAMA_PY (python for convert_hf_to_gguf.py, with numpy, torch and sentencepiece; default
#      .venv/bin/python), DTYPE (bf16)
# From a llama.cpp you built yourself, LLAMA_CPP_DIR needs: build/bin/llama-bench,
# convert_hf_to_gguf.py and gguf-py/ (this project carries no way to build it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PROMPT=${PROMPT:-512} GEN=${GEN:-128} REPS=${REPS:-3}
. bench/common.sh
ids=$($PY -c "import random; random.seed(1); print(','.join(str(random.randrange(3, 32000)) for _ in range($PROMPT)))")

if [ -n "$gguf" ]; then
    bench_bin="$LLAMA_CPP_DIR/build/bin/llama-bench"
    [ -x "$bench_bin" ] || { echo "forward.sh: $bench_bin not found (build llama.cpp first)" >&2; exit 1; }
fi

cs_runs=() ll_runs=() bf_runs=() kernels="" kernels_bf16=""
for r in $(seq "$REPS"); do
    line=$("$BUILD/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens 1 \
        --stats --threads "$THREADS" 2>&1 >/dev/null | grep '^stats:')
    pp=$(sed -E 's/.*prefill [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/' <<<"$line")
    kernels=$(sed -E 's/.*cpu \(([^ ]+) kernels.*/\1/' <<<"$line")
    # one prompt token, then GEN decode steps (the first token comes from the prefill)
    line=$("$BUILD/caraserve" generate --model "$model" --prompt-ids 1 --max-tokens $((GEN + 1)) --ignore-eos \
        --stats --threads "$THREADS" 2>&1 >/dev/null | grep '^stats:')
    tg=$(sed -E 's/.*decode [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/' <<<"$line")
    # GEN decode steps after the prompt, as llama-bench -pg runs them
    line=$("$BUILD/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens $((GEN + 1)) --ignore-eos \
        --stats --threads "$THREADS" 2>&1 >/dev/null | grep '^stats:')
    pg=$($PY -c "import re,sys; ms=[float(x) for x in re.findall(r'in ([0-9.]+) ms', sys.argv[1])]; print(round(($PROMPT + $GEN) / (ms[0] + ms[1]) * 1e3, 2))" "$line")
    cs_runs+=("$pp:$tg:$pg")
    line=$("$BUILD/caraserve" generate --model "$model" --prompt-ids "$ids" --max-tokens 1 --precision bf16 \
        --stats --threads "$THREADS" 2>&1 >/dev/null | grep '^stats:')
    bpp=$(sed -E 's/.*prefill [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/' <<<"$line")
    kernels_bf16=$(sed -E 's/.*cpu \(([^ ]+) kernels.*/\1/' <<<"$line")
    bf_runs+=("$bpp")
    echo "caraserve rep $r: prefill with --precision bf16 $bpp tok/s" >&2
    echo "caraserve rep $r: prefill $pp tok/s, decode $tg tok/s, pp${PROMPT}+tg${GEN} $pg tok/s" >&2
    if [ -n "$gguf" ]; then
        js=$("$bench_bin" -m "$gguf" -p "$PROMPT" -n "$GEN" -pg "$PROMPT,$GEN" -t "$THREADS" -r 1 -o json 2>/dev/null)
        lp=$($PY -c "import json,sys; d=json.loads(sys.argv[1]); print([x['avg_ts'] for x in d if x['n_prompt']>0 and x['n_gen']==0][0])" "$js")
        lt=$($PY -c "import json,sys; d=json.loads(sys.argv[1]); print([x['avg_ts'] for x in d if x['n_gen']>0 and x['n_prompt']==0][0])" "$js")
        lg=$($PY -c "import json,sys; d=json.loads(sys.argv[1]); print([x['avg_ts'] for x in d if x['n_gen']>0 and x['n_prompt']>0][0])" "$js")
        ll_runs+=("$lp:$lt:$lg")
        echo "llama.cpp rep $r: prefill $lp tok/s, decode $lt tok/s, pp${PROMPT}+tg${GEN} $lg tok/s" >&2
    fi
done

out="bench/results/forward-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$out" "$PROMPT" "$GEN" "$THREADS" "$DTYPE" "${LLAMA_CPP_DIR:-}" "${cs_runs[*]}" "${ll_runs[*]:-}" "$kernels" \
    "${bf_runs[*]}" "$kernels_bf16" <<'PYEOF'
import json, os, platform, statistics, subprocess, sys
out, prompt, gen, threads, dtype, llama_dir, cs, ll, kernels, bf, kernels_bf16 = sys.argv[1:12]
def parse(s):
    runs = [tuple(float(v) for v in r.split(":")) for r in s.split()] if s.strip() else []
    med = lambda k: statistics.median(r[k] for r in runs) if runs else None  # noqa: E731
    return {"prefill_tok_s": [r[0] for r in runs], "decode_tok_s": [r[1] for r in runs],
            "prompt_then_gen_tok_s": [r[2] for r in runs],
            "prefill_median": med(0), "decode_median": med(1), "prompt_then_gen_median": med(2)}
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
res = {"benchmark": "forward", "model": "llama 200M (hidden 1024, 12 layers, 16 heads, inter 2816, vocab 32000)",
       "caraserve_weights": dtype.upper(), "prompt_tokens": int(prompt), "gen_tokens": int(gen), "threads": int(threads),
       "cpu": cpu, "nproc": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
       "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
               if f in next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])],
       "kernel_path": kernels, "switches": {k: os.environ[k] for k in ("CS_NO_AVX512", "CS_NO_AMX", "CS_NO_DPBF16", "CS_NO_PACKED") if k in os.environ},
       "caraserve": parse(cs)}
bfr = [float(v) for v in bf.split()]
res["caraserve_precision_bf16"] = {"kernel_path": kernels_bf16, "prefill_tok_s": bfr,
                                   "prefill_median": statistics.median(bfr) if bfr else None}
if llama_dir:
    res["llama_cpp"] = dict(parse(ll), weights="F16", dir=llama_dir)
    res["ratio_prefill"] = res["caraserve"]["prefill_median"] / res["llama_cpp"]["prefill_median"]
    res["ratio_decode"] = res["caraserve"]["decode_median"] / res["llama_cpp"]["decode_median"]
    res["ratio_prompt_then_gen"] = res["caraserve"]["prompt_then_gen_median"] / res["llama_cpp"]["prompt_then_gen_median"]
    if bfr:
        res["ratio_prefill_bf16"] = res["caraserve_precision_bf16"]["prefill_median"] / res["llama_cpp"]["prefill_median"]
json.dump(res, open(out, "w"), indent=2)
c = res["caraserve"]
print(f"cpu: {cpu} ({', '.join(res['isa'])}), kernels {kernels}")
print(f"caraserve ({dtype}, {threads} threads): prefill {c['prefill_median']:.1f} tok/s, decode {c['decode_median']:.2f} tok/s, "
      f"prompt+gen {c['prompt_then_gen_median']:.2f} tok/s")
if bfr:
    print(f"caraserve --precision bf16 ({kernels_bf16}): prefill {res['caraserve_precision_bf16']['prefill_median']:.1f} tok/s")
if llama_dir:
    l = res["llama_cpp"]
    print(f"llama.cpp (F16, {threads} threads):  prefill {l['prefill_median']:.1f} tok/s, decode {l['decode_median']:.2f} tok/s, "
          f"prompt+gen {l['prompt_then_gen_median']:.2f} tok/s")
    print(f"ratio caraserve/llama.cpp: prefill {res['ratio_prefill']:.2f}x, decode {res['ratio_decode']:.2f}x, "
          f"prompt+gen {res['ratio_prompt_then_gen']:.2f}x" +
          (f", prefill with --precision bf16 {res['ratio_prefill_bf16']:.2f}x" if bfr else ""))
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
