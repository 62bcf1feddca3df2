#!/usr/bin/env bash
# bench/engine.sh: the serving engine's throughput on the ~200M Llama of bench/forward.sh
# (BF16, 2 threads), side by side in one run:
#   - decode tokens/s at batch 1, 8, 32 with 0, 1 and 8 distinct rank-16 adapters (all
#     targets), measured over the decode-only iterations of `caraserve batch`;
#   - the LoRA overhead with 8 distinct adapters in one batch (vs the base model alone at the
#     same batch size) and the batch-32 decode throughput against batch 1;
#   - prefill of a PROMPT-token prompt (tokens/s);
#   - the memory-bandwidth roofline of batch-1 decode: bench/membw's read bandwidth divided
#     by the bytes of weights one token reads;
#   - the compute roofline of batch-32 decode: the peak of the instruction the matmuls run on
#     (F32 FMA, or vdpbf16ps under --precision bf16; `bench/kernelbench --peak`, beside each
#     batch-32 run) over the matmuls' flops per token, and from it the most batch 32 can be
#     over batch 1 on this machine (batch32_vs_batch1_cap: the compute roofline over the
#     batch 1 measured in the same repetition; not on AMX, whose peak is not measured), and
#     the most a prefill on that instruction can be over llama.cpp's (prefill_vs_llama_cpp_cap);
#   - with LLAMA_CPP_DIR, llama.cpp on the same shapes (F16 GGUF of the same checkpoint):
#     llama-bench pp/tg and llama-batched-bench decode at the same batch sizes.
# Configurations alternate within each repetition so machine noise hits all alike, and the
# ratios are also taken within each repetition (the *_paired keys: the median of the
# repetitions' ratios, so one slow stretch of a VM does not decide a ratio); the
# JSON lands in bench/results/ with the CPU, its ISA features and the kernel path (set
# CS_NO_AVX512=1, CS_NO_AMX=1 to run the AVX2 path on an AVX-512 CPU). Quiet the machine first.
#
#   bench/engine.sh
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/engine.sh
# Env: BUILD (build), THREADS (2), GEN (64), PROMPT (512), REPS (3), CACHE, LLAMA_PY, DTYPE (bf16),
#      PRECISION (exact; bf16 runs caraserve with --precision bf16), LORA_DTYPE (auto: the
#      adapters, written in F32 as peft saves them, held in F32; bf16: --lora-dtype bf16),
#      EXTRA (more caraserve flags, e.g. --compress-weights: then batch 1's roofline counts the
#      coded bytes it reads, from --stats)
# From a llama.cpp you built yourself, LLAMA_CPP_DIR needs: build/bin/llama-bench,
# build/bin/llama-batched-bench, convert_hf_to_gguf.py and gguf-py/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEN=${GEN:-64} PROMPT=${PROMPT:-512} REPS=${REPS:-3} PRECISION=${PRECISION:-exact} LORA_DTYPE=${LORA_DTYPE:-auto}
read -r -a extra <<< "${EXTRA:-}"
. bench/common.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bench_adapters # lora_args: --lora ad0..ad7 (bench/common.sh)

# requests: B sequences with 16-token prompts, GEN tokens each, adapters round-robin over A
mkreq() { # B A -> file
    $PY - "$1" "$2" "$GEN" > "$work/req-$1-$2.jsonl" <<'PYEOF'
import json, random, sys
b, a, gen = map(int, sys.argv[1:4])
random.seed(b * 100 + a)
for i in range(b):
    r = {"prompt_ids": [random.randrange(3, 32000) for _ in range(16)], "max_tokens": gen, "ignore_eos": True,
         "temperature": 0}
    if a:
        r["adapter"] = f"ad{i % a}"
    print(json.dumps(r))
PYEOF
    echo "$work/req-$1-$2.jsonl"
}
configs="1:0 1:1 8:0 8:1 8:8 32:0 32:1 32:8"
for c in $configs; do mkreq "${c%%:*}" "${c##*:}" >/dev/null; done
$PY -c "import random; random.seed(1); print('{\"prompt_ids\": [' + ','.join(str(random.randrange(3, 32000)) for _ in range($PROMPT)) + '], \"max_tokens\": 1}')" > "$work/prefill.jsonl"


results="$work/runs.jsonl"
: > "$results"
for r in $(seq "$REPS"); do
    if [ -x "$BUILD/bench/membw" ]; then
        bw=$("$BUILD/bench/membw" --threads "$THREADS" 2>/dev/null | tail -1 || true)
        [ -n "$bw" ] && echo "{\"kind\": \"membw\", \"rep\": $r, \"out\": $bw}" >> "$results"
    fi
    for c in $configs; do
        b=${c%%:*} a=${c##*:}
        st=$(batch_stats "$BUILD/caraserve" --model "$model" "${lora_args[@]}" --requests "$work/req-$b-$a.jsonl" \
            --precision "$PRECISION" --lora-dtype "$LORA_DTYPE" --max-num-seqs 64 --kv-cache-bytes 2G "${extra[@]}")
        echo "{\"kind\": \"decode\", \"rep\": $r, \"batch\": $b, \"adapters\": $a, \"stats\": $st}" >> "$results"
        echo "rep $r batch $b adapters $a: $(decode_tps "$st")" >&2
        if [ "$c" = "32:0" ] && [ -x "$BUILD/bench/kernelbench" ]; then # the compute peak, right after batch 32
            pk=$("$BUILD/bench/kernelbench" --peak --threads "$THREADS" 2>/dev/null | tail -1 || true)
            [ -n "$pk" ] && echo "{\"kind\": \"peak\", \"rep\": $r, \"out\": $pk}" >> "$results"
        fi
        if [ "$c" = "1:0" ] && [ -x "$BUILD/bench/membw" ]; then # the bandwidth right after batch 1, too
            bw=$("$BUILD/bench/membw" --threads "$THREADS" 2>/dev/null | tail -1 || true)
            [ -n "$bw" ] && echo "{\"kind\": \"membw_after\", \"rep\": $r, \"out\": $bw}" >> "$results"
        fi
    done
    st=$(batch_stats "$BUILD/caraserve" --model "$model" --requests "$work/prefill.jsonl" --precision "$PRECISION" \
        "${extra[@]}" --max-num-batched-tokens "$PROMPT")
    echo "{\"kind\": \"prefill\", \"rep\": $r, \"stats\": $st}" >> "$results"
    if [ -n "$gguf" ]; then
        js=$("$LLAMA_CPP_DIR/build/bin/llama-bench" -m "$gguf" -p "$PROMPT" -n "$GEN" -t "$THREADS" -r 1 -o json 2>/dev/null \
            | $PY -c "import sys,json; print(json.dumps(json.load(sys.stdin)))")
        echo "{\"kind\": \"llama-bench\", \"rep\": $r, \"out\": $js}" >> "$results"
        bb="$LLAMA_CPP_DIR/build/bin/llama-batched-bench"
        if [ -x "$bb" ]; then
            out=$("$bb" -m "$gguf" -c 4096 -b 2048 -ub 512 -npp 16 -ntg "$GEN" -npl 1,8,32 -t "$THREADS" \
                --output-format jsonl 2>/dev/null | grep '^{' | $PY -c "import sys,json; print(json.dumps([json.loads(l) for l in sys.stdin]))")
            echo "{\"kind\": \"llama-batched-bench\", \"rep\": $r, \"out\": $out}" >> "$results"
        fi
    fi
done

out="bench/results/engine-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$model" "$THREADS" "$GEN" "$PROMPT" "$DTYPE" "$PRECISION" "$LORA_DTYPE" "${EXTRA:-}" <<'PYEOF'
import json, os, statistics, subprocess, sys
runs_path, out, model, threads, gen, prompt, dtype, precision, lora_dtype, extra = sys.argv[1:11]
runs = [json.loads(l) for l in open(runs_path)]
med = statistics.median
dec = {}
kernels = None
for r in runs:
    if r["kind"] == "decode":
        s = r["stats"]
        kernels = s.get("backend", {}).get("kernels", kernels)
        dec.setdefault((r["batch"], r["adapters"]), []).append(s["decode_only_tokens"] / s["decode_only_ms"] * 1e3)
pre = [r["stats"]["prefill_tokens"] / r["stats"]["busy_ms"] * 1e3 for r in runs if r["kind"] == "prefill"]
# bytes of weights one decode token reads: every matrix once (embedding rows are negligible)
cfg = json.load(open(os.path.join(model, "config.json")))
h, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
kvd = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"])
per_layer = h * h * 2 + h * kvd * 2 + 3 * h * inter
params = L * per_layer + V * h # the matmuls' weights (the LM head's included)
wbytes = params * (2 if dtype in ("bf16", "f16") else 4)
# what batch 1 reads instead with --compress-weights: the same matrices coded (--stats)
coded = next((r["stats"]["weights"].get("coded_bytes", 0) for r in runs if r["kind"] == "decode"), 0)
wbytes1 = coded or wbytes
bws = [r["out"]["read_gb_s_best"] for r in runs if r["kind"] == "membw" and "read_gb_s_best" in r.get("out", {})]
res = {"benchmark": "engine", "model": f"llama ~200M ({h} hidden, {L} layers, inter {inter}, vocab {V}), {dtype.upper()}",
       "threads": int(threads), "gen_tokens": int(gen), "adapter_rank": 16, "precision": precision,
       "adapter_files": "F32", "lora_dtype": lora_dtype,
       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
       "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
               if f in next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])],
       "kernel_path": kernels, "switches": {k: os.environ[k] for k in ("CS_NO_AVX512", "CS_NO_AMX", "CS_NO_DPBF16", "CS_NO_PACKED") if k in os.environ},
       "decode_tok_s": {f"batch{b}_adapters{a}": {"runs": v, "median": med(v)} for (b, a), v in sorted(dec.items())},
       "prefill_tok_s": {"prompt": int(prompt), "runs": pre, "median": med(pre) if pre else None},
       "extra_flags": extra, "weight_bytes_per_token": wbytes, "batch1_read_bytes_per_token": wbytes1}
d = {k: v["median"] for k, v in res["decode_tok_s"].items()}
for b in (8, 32):
    if f"batch{b}_adapters8" in d:
        res[f"lora_overhead_batch{b}_8_adapters"] = d[f"batch{b}_adapters0"] / d[f"batch{b}_adapters8"] - 1
res["batch32_vs_batch1"] = d["batch32_adapters0"] / d["batch1_adapters0"]
# paired: the same ratios within each repetition (its runs a minute apart), then their median,
# so that a slow stretch of the machine in one run does not decide a ratio
def rep_tok_s(rep, b, a):
    v = [r["stats"] for r in runs if r["kind"] == "decode" and r["rep"] == rep and r["batch"] == b and r["adapters"] == a]
    return v[0]["decode_only_tokens"] / v[0]["decode_only_ms"] * 1e3 if v else None
reps = sorted({r["rep"] for r in runs if r["kind"] == "decode"})
for name, num, den in [("batch32_vs_batch1", (32, 0), (1, 0))] + \
        [(f"lora_overhead_batch{b}_8_adapters", (b, 0), (b, 8)) for b in (8, 32)]:
    v = [rep_tok_s(rep, *num) / rep_tok_s(rep, *den) - (1 if name.startswith("lora") else 0)
         for rep in reps if rep_tok_s(rep, *num) and rep_tok_s(rep, *den)]
    if v:
        res[name + "_paired"] = {"runs": v, "median": med(v)}
if bws:
    bw = med(bws)
    res["membw_read_gb_s"] = {"runs": bws, "median": bw}
    res["roofline_decode_tok_s"] = bw * 1e9 / wbytes1
    res["batch1_fraction_of_roofline"] = d["batch1_adapters0"] / res["roofline_decode_tok_s"]
    # paired: each repetition's batch-1 run against the bandwidth measured just before and
    # just after it (this VM's bandwidth swings by a third over minutes)
    pairs = []
    for rep in sorted({r["rep"] for r in runs}):
        b1 = [r for r in runs if r["kind"] == "decode" and r["rep"] == rep and r["batch"] == 1 and r["adapters"] == 0]
        around = [r["out"]["read_gb_s_best"] for r in runs if r["kind"] in ("membw", "membw_after")
                  and r["rep"] == rep and "read_gb_s_best" in r.get("out", {})]
        if b1 and len(around) == 2:
            s = b1[0]["stats"]
            pairs.append(s["decode_only_tokens"] / s["decode_only_ms"] * 1e3 * wbytes1 / (sum(around) / 2 * 1e9))
    if pairs:
        res["batch1_fraction_of_roofline_paired"] = {"runs": pairs, "median": med(pairs)}
# the compute roofline of batch-32 decode: the matmuls' flops per token (2 per weight; attention
# over these short contexts is left out, so the roofline is if anything too high) at the peak of
# the instruction the kernel path multiplies with (vdpbf16ps only against BF16 weights: F16/F32
# weights under --precision bf16 stay F32 FMAs)
flops = 2 * params
path = kernels or ""
peak_key = None if "amx" in path else \
    "dpbf16_peak_gflops" if precision == "bf16" and dtype == "bf16" and "avx512bf16" in path else \
    "fma_peak_gflops_avx512" if path.startswith("avx512") else "fma_peak_gflops_avx2" if path.startswith("avx2") else None
pk = {r["rep"]: r["out"][peak_key] for r in runs if r["kind"] == "peak" and peak_key and r["out"].get(peak_key)}
if pk:
    res["flops_per_token"] = flops
    res["compute_peak"] = {"instruction": peak_key.replace("_peak_gflops", ""), "gflops": {"runs": list(pk.values()),
                           "median": med(pk.values())}}
    roof = res["compute_peak"]["gflops"]["median"] * 1e9 / flops
    res["roofline_batch32_tok_s"] = roof
    res["batch32_fraction_of_compute_roofline"] = d["batch32_adapters0"] / roof
    res["batch32_vs_batch1_cap"] = roof / d["batch1_adapters0"]
    v = [pk[rep] * 1e9 / flops / rep_tok_s(rep, 1, 0) for rep in reps if rep in pk and rep_tok_s(rep, 1, 0)]
    if v:
        res["batch32_vs_batch1_cap_paired"] = {"runs": v, "median": med(v)}
lb = [r["out"] for r in runs if r["kind"] == "llama-bench"]
if lb:
    pp = [x["avg_ts"] for o in lb for x in o if x["n_prompt"] > 0 and x["n_gen"] == 0]
    tg = [x["avg_ts"] for o in lb for x in o if x["n_gen"] > 0 and x["n_prompt"] == 0]
    res["llama_cpp"] = {"weights": "F16", "prefill_tok_s": med(pp), "decode_batch1_tok_s": med(tg)}
    res["prefill_vs_llama_cpp"] = res["prefill_tok_s"]["median"] / med(pp)
    if "roofline_batch32_tok_s" in res: # the most any kernel on that instruction could be over llama.cpp's prefill
        res["prefill_vs_llama_cpp_cap"] = res["roofline_batch32_tok_s"] / med(pp)
        res["prefill_fraction_of_compute_roofline"] = res["prefill_tok_s"]["median"] / res["roofline_batch32_tok_s"]
    res["decode_batch1_vs_llama_cpp"] = d["batch1_adapters0"] / med(tg)
bb = [r["out"] for r in runs if r["kind"] == "llama-batched-bench"]
if bb:
    for b in (1, 8, 32):
        v = [x["speed_tg"] for o in bb for x in o if x.get("pl") == b]
        if v:
            res.setdefault("llama_cpp", {})[f"decode_batch{b}_tok_s"] = med(v)
            res[f"decode_batch{b}_vs_llama_cpp"] = d[f"batch{b}_adapters0"] / med(v)
            pv = [] # paired, as above: each repetition against its own llama-batched-bench
            for rep in reps:
                lv = [x["speed_tg"] for r in runs if r["kind"] == "llama-batched-bench" and r["rep"] == rep
                      for x in r["out"] if x.get("pl") == b]
                if lv and rep_tok_s(rep, b, 0):
                    pv.append(rep_tok_s(rep, b, 0) / lv[0])
            if pv:
                res[f"decode_batch{b}_vs_llama_cpp_paired"] = {"runs": pv, "median": med(pv)}
json.dump(res, open(out, "w"), indent=2)
print(f"cpu: {res['cpu']} ({', '.join(res['isa'])}), kernels {kernels}")
for k, v in d.items():
    print(f"decode {k}: {v:.2f} tok/s")
for k in sorted(res):
    if k.startswith(("lora_overhead", "batch32", "roofline", "batch1_fraction", "prefill_vs", "prefill_fraction", "decode_batch")):
        v = res[k]["median"] if isinstance(res[k], dict) else res[k]
        print(f"{k}: {v:.3f}")
print(f"prefill {prompt}: {res['prefill_tok_s']['median']:.1f} tok/s")
print(f"wrote {out}")
PYEOF
bench_stamp "$out"
