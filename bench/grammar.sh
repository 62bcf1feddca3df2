#!/usr/bin/env bash
# bench/grammar.sh: what structured output costs, side by side in one run.
#
# 1. Per-token mask time and compile time on the same JSON schemas and the same vocabularies
#    (Llama 3.1's 128k and Qwen3's 151k tokenizers), following the same valid output token by
#    token: caraserve's engine (bench/grammarbench) beside xgrammar and llguidance (PyPI, on
#    the CPU; installed into $CACHE/grammar-peers, never into .venv). The mask time is given
#    for the first pass over the output (a fresh grammar) and for five more (what every later
#    request with the same schema pays).
# 2. The decode cost of a constrained request: `caraserve serve` on the ~200M bench model
#    (bench/common.sh), the same requests with and without a JSON schema, at batch 1 and 32,
#    completion tokens per second side by side (the ratio is the slowdown).
# The JSON lands in bench/results/grammar-<stamp>.json.
#
#   bench/grammar.sh
# Env: BUILD (build), THREADS (2), CACHE, SKIP_DECODE=1 (part 1 only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. bench/common.sh
PEERS="$CACHE/grammar-peers"
if [ ! -d "$PEERS/xgrammar" ] || [ ! -d "$PEERS/llguidance" ]; then
    "$PY" -m pip install -q --no-deps --target "$PEERS" xgrammar==0.1.27 llguidance==1.9.1 >&2
fi
make -C "$BUILD" -s bench/grammarbench >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out="bench/results/grammar-$(date -u +%Y%m%dT%H%M%SZ).json"

"$PY" - "$work" <<'PYEOF'
import json, sys
work = sys.argv[1]
person = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "kind": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["street", "city"], "additionalProperties": False}},
    "required": ["name", "age", "kind"], "additionalProperties": False}
cases = {
    "person": (person, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "kind": "admin",
                        "tags": ["math", "engines", "poetry"],
                        "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"}}),
    "json_object": (None, {"title": "A long answer", "items": [{"id": i, "text": f"item number {i} of the list",
                                                                "ok": i % 2 == 0, "score": i * 1.5} for i in range(8)],
                           "note": "unicode: caf\u00e9 \u65e5\u672c\u8a9e, quotes \" and \\\\ escapes"}),
}
for name, (schema, inst) in cases.items():
    if schema is not None:
        json.dump(schema, open(f"{work}/{name}.schema.json", "w"))
    open(f"{work}/{name}.json", "w").write(json.dumps(inst, separators=(",", ":"), ensure_ascii=False))
PYEOF

results="$work/results.jsonl"
: > "$results"
for tok in llama-3.1 qwen3; do
    d="$work/tok-$tok"
    mkdir -p "$d"
    xz -dc "tests/data/tokenizers/$tok/tokenizer.json.xz" > "$d/tokenizer.json"
    cp "tests/data/tokenizers/$tok/tokenizer_config.json" "$d/"
    for case in person json_object; do
        schema="$work/$case.schema.json"
        [ -f "$schema" ] || schema=-
        "$PY" -c "import sys; from transformers import AutoTokenizer as A; t=A.from_pretrained(sys.argv[1]); \
print(*t.encode(open(sys.argv[2]).read(), add_special_tokens=False))" "$d" "$work/$case.json" > "$work/$case.$tok.tokens"
        ours=$("$BUILD/bench/grammarbench" "$d" "$schema" "$work/$case.$tok.tokens")
        peers=$(PYTHONPATH="$PEERS" "$PY" bench/grammar_peers.py "$d" "$schema" "$work/$case.$tok.tokens")
        printf '%s\n%s\n' "$ours" "$peers" | "$PY" -c "import json, sys
for l in sys.stdin:
    if l.strip():
        print(json.dumps({'tokenizer': sys.argv[1], 'schema': sys.argv[2], 'result': json.loads(l)}))" "$tok" "$case" >> "$results"
    done
done

decode="$work/decode.json"
echo '{}' > "$decode"
if [ -z "${SKIP_DECODE:-}" ]; then
    port=$((20000 + RANDOM % 20000))
    "$BUILD/caraserve" serve --model "$model" --port "$port" --threads "$THREADS" --kv-cache-bytes 1G \
        --served-model-name m > "$work/serve.log" 2>&1 &
    spid=$!
    trap 'kill $spid 2>/dev/null; rm -rf "$work"' EXIT
    "$PY" - "$port" "$decode" "$work/person.schema.json" <<'PYEOF'
import concurrent.futures, json, sys, time, urllib.request
port, out, schema = int(sys.argv[1]), sys.argv[2], json.load(open(sys.argv[3]))
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if urllib.request.urlopen(base + "/health").status == 200:
            break
    except Exception:
        time.sleep(0.5)

def post(body):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=3600))

res = {}
for batch in (1, 32):
    rates = {}
    for rep in range(2):
        for mode in ("constrained", "plain"):
            bodies = [{"model": "m", "prompt": f"Record {i}:", "max_tokens": 64, "temperature": 1.0, "seed": i,
                       "ignore_eos": mode == "plain"} for i in range(batch)]
            if mode == "constrained":
                for b in bodies:
                    b["guided_json"] = schema
                    b["ignore_eos"] = False
                    b["max_tokens"] = 200
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(batch) as ex:
                outs = list(ex.map(post, bodies))
            dt = time.perf_counter() - t0
            toks = sum(o["usage"]["completion_tokens"] for o in outs)
            rates.setdefault(mode, []).append(toks / dt)
    c, p = max(rates["constrained"]), max(rates["plain"])
    res[f"batch{batch}"] = {"constrained_tok_s": round(c, 2), "plain_tok_s": round(p, 2),
                            "constrained_over_plain": round(c / p, 4)}
json.dump(res, open(out, "w"))
PYEOF
    kill $spid 2>/dev/null || true
fi

"$PY" - "$results" "$decode" "$out" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
res = {"bench": "grammar", "command": "bench/grammar.sh", "masks": rows, "decode": json.load(open(sys.argv[2]))}
for r in rows:
    if r["result"].get("engine") == "caraserve":
        for p in rows:
            e = p["result"].get("engine", "")
            if p["tokenizer"] == r["tokenizer"] and p["schema"] == r["schema"] and e != "caraserve" and "mask_us_median" in p["result"]:
                r.setdefault("median_mask_ratio", {})[e.split()[0]] = round(
                    r["result"]["mask_us_median"] / p["result"]["mask_us_median"], 3)
json.dump(res, open(sys.argv[3], "w"), indent=1)
for r in rows:
    x = r["result"]
    print(f'{r["tokenizer"]:9} {r["schema"]:11} {x.get("engine", "?"):18} compile {x.get("compile_ms", "-"):>8} ms  '
          f'mask first {x.get("first_pass_mask_us", "-"):>8} us  median {x.get("mask_us_median", "-"):>7} us')
print(json.dumps(res["decode"]))
PYEOF
bench_stamp "$out"
echo "$out"
