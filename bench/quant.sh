#!/usr/bin/env bash
# bench/quant.sh: quantized GGUF models, caraserve beside llama.cpp on the same files in one run.
# The ~200M Llama of bench/engine.sh (bench/common.sh), converted to an F16 GGUF by llama.cpp's
# convert_hf_to_gguf.py and quantized by its llama-quantize to each of TYPES; for each file:
#   - caraserve batch (--precision int8, and exact at batch 1): decode tokens/s at batch 1, 8,
#     32, and at batch 8 with 8 distinct rank-16 adapters against the base; prefill of PROMPT;
#     at batch 1 also with the KV cache in BF16 (llama.cpp's is F16 by default, ours F32);
#     where the CPU has AVX512-VNNI, int8 on the AVX2 kernels too (int8avx2: CS_NO_VNNI=1);
#   - llama-bench (pp PROMPT, tg GEN) and llama-batched-bench (decode at 1, 8, 32);
#   - the read bandwidth of batch-1 decode: tok/s x the bytes of weights a token reads (every
#     tensor of the file but the embedding's, from the file's own table), over bench/membw's;
#   - perplexity against llama-perplexity's on the same files and text, on a model with real
#     weights and a byte-level BPE tokenizer both sides tokenize alike (PPL_MODEL: the demo's
#     SmolLM2-135M-Instruct directory, converted to F16 and quantized to TYPES as above; the
#     benchmark model's random weights and its SentencePiece vocabulary without scores, which
#     llama.cpp's converter writes as -1000 for every token, would compare tokenizers, not
#     numerics): PPL_TEXT (the docs/ pages) in chunks of 512 tokens, llama-perplexity's tokens
#     and log-probabilities (F32 KV cache) against caraserve's on the same tokens (int8, exact,
#     int8 --batch-invariant): KL divergence, same top token, perplexity (bench/quant_ppl.py);
#   - greedy continuations (GREEDY_TOKENS) of 8 prompts on those files against llama.cpp's
#     (bench/quant_greedy.py: llama-completion with an F32 KV cache, or llama-simple), with our
#     log-probability margin where they part, and caraserve's int8 against itself with
#     --batch-invariant as the yardstick.
# Configurations alternate within each repetition; the ratios are per repetition (medians of
# them). JSON in bench/results/quant-*.json with the CPU and the kernel paths. Quiet the machine.
#
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/quant.sh
# Env: BUILD (build), THREADS (2), GEN (64), PROMPT (512), REPS (3), TYPES ("Q8_0 Q4_K_M Q6_K"),
#      PPL_CHUNKS (4), PPL_TEXT (docs/*.md concatenated), PPL_MODEL (demo/smollm2-135m-instruct;
#      none: no perplexity), GREEDY_TOKENS (32), CACHE, LLAMA_PY
# LLAMA_CPP_DIR needs build/bin/llama-bench, llama-batched-bench, llama-quantize,
# llama-perplexity, and convert_hf_to_gguf.py (with gguf-py/, or the gguf package installed);
# llama-completion (or llama-simple) for the greedy comparison, left out without.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -n "${LLAMA_CPP_DIR:-}" ] || { echo "bench/quant.sh: set LLAMA_CPP_DIR to a llama.cpp build" >&2; exit 2; }
GEN=${GEN:-64} PROMPT=${PROMPT:-512} GREEDY_TOKENS=${GREEDY_TOKENS:-32} REPS=${REPS:-3} TYPES=${TYPES:-"Q8_0 Q4_K_M Q6_K"} PPL_CHUNKS=${PPL_CHUNKS:-4}
. bench/common.sh # $model (BF16 directory), $gguf (its F16 GGUF)
bin="$LLAMA_CPP_DIR/build/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bench_adapters # lora_args: --lora ad0..ad7

files=()
for t in $TYPES; do
    f="$CACHE/llama-200m-$t.gguf"
    [ -f "$f" ] || "$bin/llama-quantize" "$gguf" "$f" "$t" >/dev/null 2>&1 || { echo "llama-quantize $t failed" >&2; exit 1; }
    files+=("$t:$f")
done

mkreq() { # B A -> requests: B sequences, 16-token prompts, GEN tokens each, adapters round-robin over A
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
}
configs="1:0 8:0 32:0 8:8"
# int8avx2: --precision int8 on the AVX2 kernels (CS_NO_VNNI) where the CPU has AVX512-VNNI, at
# batch 1 and prefill: the repacked VNNI kernels' gain, side by side
precs="int8 exact"
grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null && precs="int8 exact int8avx2"
for c in $configs; do mkreq "${c%%:*}" "${c##*:}"; done
$PY -c "import random; random.seed(1); print('{\"prompt_ids\": [' + ','.join(str(random.randrange(3, 32000)) for _ in range($PROMPT)) + '], \"max_tokens\": 1}')" > "$work/prefill.jsonl"

results="$work/runs.jsonl"
: > "$results"
for r in $(seq "$REPS"); do
    if [ -x "$BUILD/bench/membw" ]; then
        bw=$("$BUILD/bench/membw" --threads "$THREADS" 2>/dev/null | tail -1 || true)
        [ -n "$bw" ] && echo "{\"kind\": \"membw\", \"rep\": $r, \"out\": $bw}" >> "$results"
    fi
    for tf in "${files[@]}"; do
        t=${tf%%:*} f=${tf#*:}
        for c in $configs; do
            b=${c%%:*} a=${c##*:}
            # int8lbf16: the adapters held in BF16 (--lora-dtype bf16, as vLLM holds them in the
            # model's dtype): half the bytes the 8 adapters add to each step; int8kv16: batch 1
            # with the KV cache in BF16 (--kv-cache-dtype bf16), as many bytes as llama.cpp's
            # default F16 cache (ours is F32 unless asked)
            for prec in $precs int8lbf16 int8kv16; do
                case "$prec:$c" in
                int8:* | exact:1:0 | int8avx2:1:0 | int8lbf16:8:8 | int8kv16:1:0) ;;
                *) continue ;;
                esac
                novnni="" ldt=auto pflag=$prec kvt=auto
                case $prec in int8*) pflag=int8 ;; esac
                [ "$prec" = int8avx2 ] && novnni=1
                [ "$prec" = int8lbf16 ] && ldt=bf16
                [ "$prec" = int8kv16 ] && kvt=bf16
                st=$(CS_NO_VNNI=$novnni batch_stats "$BUILD/caraserve" --model "$f" "${lora_args[@]}" \
                    --requests "$work/req-$b-$a.jsonl" --precision "$pflag" --lora-dtype "$ldt" --max-num-seqs 64 \
                    --kv-cache-bytes 2G --kv-cache-dtype "$kvt")
                echo "{\"kind\": \"decode\", \"type\": \"$t\", \"precision\": \"$prec\", \"rep\": $r, \"batch\": $b, \"adapters\": $a, \"stats\": $st}" >> "$results"
                echo "rep $r $t $prec batch $b adapters $a: $(decode_tps "$st")" >&2
            done
        done
        for prec in $precs; do
            novnni=""
            [ "$prec" = int8avx2 ] && novnni=1
            st=$(CS_NO_VNNI=$novnni batch_stats "$BUILD/caraserve" --model "$f" --requests "$work/prefill.jsonl" \
                --precision "${prec%avx2}" --max-num-batched-tokens "$PROMPT")
            echo "{\"kind\": \"prefill\", \"type\": \"$t\", \"precision\": \"$prec\", \"rep\": $r, \"stats\": $st}" >> "$results"
        done
        js=$("$bin/llama-bench" -m "$f" -p "$PROMPT" -n "$GEN" -t "$THREADS" -r 1 -o json 2>/dev/null \
            | $PY -c "import sys,json; print(json.dumps(json.load(sys.stdin)))")
        echo "{\"kind\": \"llama-bench\", \"type\": \"$t\", \"rep\": $r, \"out\": $js}" >> "$results"
        out=$("$bin/llama-batched-bench" -m "$f" -c 4096 -b 2048 -ub 512 -npp 16 -ntg "$GEN" -npl 1,8,32 -t "$THREADS" \
            --output-format jsonl 2>/dev/null | grep '^{' | $PY -c "import sys,json; print(json.dumps([json.loads(l) for l in sys.stdin]))")
        echo "{\"kind\": \"llama-batched-bench\", \"type\": \"$t\", \"rep\": $r, \"out\": $out}" >> "$results"
    done
done

# perplexity on the same text, once per file of the real-weights model
PPL_MODEL=${PPL_MODEL:-${CS_DEMO_MODEL:-demo/smollm2-135m-instruct}}
pfiles=()
if [ -f "$PPL_MODEL/config.json" ]; then
    pf16="$CACHE/ppl-$(basename "$PPL_MODEL")-f16.gguf"
    [ -f "$pf16" ] || PYTHONPATH="$LLAMA_CPP_DIR/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$LLAMA_PY" \
        "$LLAMA_CPP_DIR/convert_hf_to_gguf.py" "$PPL_MODEL" --outtype f16 --outfile "$pf16" >&2
    for t in $TYPES; do
        f="$CACHE/ppl-$(basename "$PPL_MODEL")-$t.gguf"
        [ -f "$f" ] || "$bin/llama-quantize" "$pf16" "$f" "$t" >/dev/null 2>&1 || { echo "llama-quantize $t failed" >&2; exit 1; }
        pfiles+=("$t:$f")
    done
else
    echo "bench/quant.sh: no $PPL_MODEL/config.json: perplexity left out" >&2
fi
text="$work/ppl.txt"
# the first PPL_CHUNKS x 2.5 KB, about 1.6x the tokens the chunks score (cut at a line end): both
# sides tokenize all of it, and caraserve's tokenization runs the prompt too
if [ -n "${PPL_TEXT:-}" ]; then cat "$PPL_TEXT"; else cat docs/*.md; fi | $PY -c "
import sys
t = sys.stdin.read()[:2560 * $PPL_CHUNKS]
sys.stdout.write(t[:t.rfind(chr(10)) + 1])" > "$text"
for tf in ${pfiles[@]+"${pfiles[@]}"}; do
    t=${tf%%:*} f=${tf#*:}
    o=$($PY bench/quant_ppl.py "$BUILD/caraserve" "$bin/llama-perplexity" "$f" "$text" 512 "$PPL_CHUNKS" "$THREADS")
    echo "{\"kind\": \"ppl\", \"type\": \"$t\", \"out\": $o}" >> "$results"
    echo "$t perplexity: $(echo "$o" | $PY -c "import json,sys; d=json.load(sys.stdin); print('llama.cpp %.4f, int8 %.4f (KLD %.2g, same top %.3f), exact %.4f (KLD %.2g); int8 vs int8 --batch-invariant KLD %.2g' % (d['llama_cpp_ppl'], d['int8']['ppl'], d['int8']['kld_mean'], d['int8']['same_top'], d['exact']['ppl'], d['exact']['kld_mean'], d['int8_vs_int8_invariant']['kld_mean']))")" >&2
done

# greedy continuations against llama.cpp's on the same files (bench/quant_greedy.py says where and
# why they may part): llama-completion with an F32 KV cache where built, else llama-simple
simple="$bin/llama-completion"
[ -x "$simple" ] || simple="$bin/llama-simple"
if [ -x "$simple" ]; then
    for tf in ${pfiles[@]+"${pfiles[@]}"}; do
        t=${tf%%:*} f=${tf#*:}
        g=$($PY bench/quant_greedy.py "$BUILD/caraserve" "$simple" "$f" "$GREEDY_TOKENS" "$THREADS")
        echo "{\"kind\": \"greedy\", \"type\": \"$t\", \"out\": $g}" >> "$results"
        echo "$t greedy: $(echo "$g" | $PY -c "import json,sys; d=json.load(sys.stdin); print(d['int8_equal'], 'of', d['n_prompts'], 'equal (int8),', d['exact_equal'], '(exact); int8 parts at margins', d['int8_margins'], '; int8 vs int8 --batch-invariant', d['int8_self_equal'], 'equal')")" >&2
    done
else
    echo "bench/quant.sh: no $bin/llama-completion or llama-simple: greedy comparison left out" >&2
fi

out="bench/results/quant-$(date -u +%Y%m%dT%H%M%SZ).json"
$PY - "$results" "$out" "$THREADS" "$GEN" "$PROMPT" "${files[@]}" <<'PYEOF'
import json, statistics, sys
import gguf
runs_path, out, threads, gen, prompt = sys.argv[1:6]
files = dict(a.split(":", 1) for a in sys.argv[6:])
runs = [json.loads(l) for l in open(runs_path)]
med = statistics.median
res = {"bench": "quant", "threads": int(threads), "gen": int(gen), "prompt": int(prompt), "types": {}}
bw = [r["out"]["read_gb_s_median"] for r in runs if r["kind"] == "membw" and isinstance(r.get("out"), dict)
      and "read_gb_s_median" in r["out"]]
res["membw_read_gb_s"] = med(bw) if bw else None
reps = sorted({r["rep"] for r in runs if "rep" in r})
for t, f in files.items():
    g = gguf.GGUFReader(f)
    tok_bytes = sum(int(x.n_bytes) for x in g.tensors if x.name != "token_embd.weight")
    if not any(x.name == "output.weight" for x in g.tensors):  # tied: the embedding is the LM head
        tok_bytes += sum(int(x.n_bytes) for x in g.tensors if x.name == "token_embd.weight")
    d = {"file": f, "bytes_per_token": tok_bytes, "decode": {}, "prefill": {}, "llama_cpp": {}}
    kernels = {}
    per = {}
    for r in runs:
        if r.get("type") != t:
            continue
        if r["kind"] == "decode":
            s = r["stats"]
            kernels[r["precision"]] = s.get("backend", {}).get("kernels")
            v = s["decode_only_tokens"] / s["decode_only_ms"] * 1e3
            per.setdefault(r["rep"], {})[(r["precision"], r["batch"], r["adapters"])] = v
        elif r["kind"] == "prefill":
            s = r["stats"]
            per.setdefault(r["rep"], {})[(r["precision"], "prefill")] = s["prefill_tokens"] / s["busy_ms"] * 1e3
        elif r["kind"] == "llama-bench":
            for row in r["out"]:
                key = "pp" if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0 else "tg"
                per.setdefault(r["rep"], {})[("llama", key)] = row["avg_ts"]
        elif r["kind"] == "llama-batched-bench":
            for row in r["out"]:
                if "pl" in row:
                    per.setdefault(r["rep"], {})[("llama", "b%d" % row["pl"])] = row["speed_tg"]
    def series(key):
        return [per[p][key] for p in reps if p in per and key in per[p]]
    def ratio(a, b):
        v = [per[p][a] / per[p][b] for p in reps if p in per and a in per[p] and b in per[p] and per[p][b] > 0]
        return med(v) if v else None
    for prec, b, a in sorted({k for p in per.values() for k in p if len(k) == 3}):
        d["decode"][f"{prec}_b{b}_a{a}"] = {"tok_s": series((prec, b, a)), "median": med(series((prec, b, a)))}
    for prec in ("int8", "exact", "int8avx2"):
        s = series((prec, "prefill"))
        if s:
            d["prefill"][prec] = {"tok_s": s, "median": med(s)}
    for k in ("pp", "tg", "b1", "b8", "b32"):
        s = series(("llama", k))
        if s:
            d["llama_cpp"][k] = {"tok_s": s, "median": med(s)}
    d["kernels"] = kernels
    d["ratios"] = {
        "decode_b1_int8_vs_llama_tg": ratio(("int8", 1, 0), ("llama", "tg")),
        "decode_b1_exact_vs_llama_tg": ratio(("exact", 1, 0), ("llama", "tg")),
        "decode_b1_int8kv16_vs_llama_tg": ratio(("int8kv16", 1, 0), ("llama", "tg")),
        "decode_b8_int8_vs_llama": ratio(("int8", 8, 0), ("llama", "b8")),
        "decode_b32_int8_vs_llama": ratio(("int8", 32, 0), ("llama", "b32")),
        "prefill_int8_vs_llama_pp": ratio(("int8", "prefill"), ("llama", "pp")),
        "prefill_exact_vs_llama_pp": ratio(("exact", "prefill"), ("llama", "pp")),
        "b8_8_adapters_vs_base": ratio(("int8", 8, 8), ("int8", 8, 0)),
        "b8_8_adapters_bf16_vs_base": ratio(("int8lbf16", 8, 8), ("int8", 8, 0)),
    }
    if any(("int8avx2", 1, 0) in p for p in per.values()):
        d["ratios"]["decode_b1_int8avx2_vs_llama_tg"] = ratio(("int8avx2", 1, 0), ("llama", "tg"))
        d["ratios"]["prefill_int8avx2_vs_llama_pp"] = ratio(("int8avx2", "prefill"), ("llama", "pp"))
    if res["membw_read_gb_s"] and d["decode"].get("int8_b1_a0"):
        d["decode_b1_int8_read_gb_s"] = d["decode"]["int8_b1_a0"]["median"] * tok_bytes / 1e9
        d["decode_b1_int8_of_membw"] = d["decode_b1_int8_read_gb_s"] / res["membw_read_gb_s"]
        if d["decode"].get("int8kv16_b1_a0"):
            d["decode_b1_int8kv16_of_membw"] = d["decode"]["int8kv16_b1_a0"]["median"] * tok_bytes / 1e9 / res["membw_read_gb_s"]
    ppl = [r["out"] for r in runs if r["kind"] == "ppl" and r["type"] == t]
    if ppl:
        q = ppl[0]
        d["perplexity"] = {"file": q["model"], "caraserve_int8": q["int8"]["ppl"], "caraserve_exact": q["exact"]["ppl"],
                           "llama_cpp": q["llama_cpp_ppl"], "ratio_int8": q["int8"]["ppl_ratio"],
                           "ratio_exact": q["exact"]["ppl_ratio"], "vs_llama_cpp": q}
    gr = [r["out"] for r in runs if r["kind"] == "greedy" and r["type"] == t]
    if gr:
        g = gr[0]
        d["greedy"] = {"llama_cpp": g["llama_cpp"], "tokens": g["tokens"], "prompts": g["n_prompts"],
                       "int8_equal": g["int8_equal"], "exact_equal": g["exact_equal"],
                       "int8_max_margin": g["int8_max_margin"], "int8_margins": g["int8_margins"],
                       "int8_self_equal": g["int8_self_equal"], "int8_self_margins": g["int8_self_margins"],
                       "int8_shared_chars": [p["int8_shared_chars"] for p in g["prompts"]],
                       "exact_shared_chars": [p["exact_shared_chars"] for p in g["prompts"]],
                       "llama_cpp_chars": [len(p["llama_cpp"]) for p in g["prompts"]], "texts": g["prompts"]}
    res["types"][t] = d
json.dump(res, open(out, "w"), indent=2)
print(json.dumps({t: {**v["ratios"], "ppl": v.get("perplexity"),
                      "greedy_equal": v.get("greedy", {}).get("int8_equal")} for t, v in res["types"].items()}, indent=1))
print("wrote", out)
PYEOF
bench_stamp "$out"
