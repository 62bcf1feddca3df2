"""grammar_peers.py: the same measurement as bench/grammarbench, with xgrammar and llguidance
(bench/grammar.sh runs both side by side). Usage:

    grammar_peers.py TOKDIR SCHEMA|- TOKENS

Prints one JSON line per engine: the schema's compile time (median of 5) and the per-token
mask time while following TOKENS (a valid output), first pass and 5 more passes (mean and
median), as grammarbench prints them. SCHEMA "-": any JSON object. Compact JSON (no
whitespace), as caraserve produces by default."""
import json
import statistics
import sys
import time

from transformers import AutoTokenizer

tokdir, schema_path, tokens_path = sys.argv[1:4]
schema = None if schema_path == "-" else open(schema_path).read()
toks = [int(x) for x in open(tokens_path).read().split()]
hf = AutoTokenizer.from_pretrained(tokdir)


def report(engine, vocab, compile_ms, first, warm):
    print(json.dumps({"engine": engine, "vocab": vocab, "tokens": len(toks), "compile_ms": round(compile_ms, 3),
                      "first_pass_mask_us": round(statistics.mean(first) * 1e6, 2),
                      "mask_us_mean": round(statistics.mean(warm) * 1e6, 2),
                      "mask_us_median": round(statistics.median(warm) * 1e6, 2)}), flush=True)


def run(engine, compile_fn, new_matcher, fill, accept, vocab):
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        g = compile_fn()
        times.append((time.perf_counter() - t0) * 1e3)
    passes = []
    for _ in range(6):
        m = new_matcher(g)
        ts = []
        for t in toks:
            t0 = time.perf_counter()
            fill(m)
            ts.append(time.perf_counter() - t0)
            if not accept(m, t):
                raise SystemExit(f"{engine}: token {t} refused: the output does not follow the schema")
        passes.append(ts)
    report(engine, vocab, statistics.median(times), passes[0], [x for p in passes[1:] for x in p])


try:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def xgr_compile():
        c = xgr.GrammarCompiler(info, cache_enabled=False)
        if schema is None:  # vLLM's json_object with xgrammar: its built-in JSON grammar
            return c.compile_builtin_json_grammar()
        return c.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    run("xgrammar " + getattr(xgr, "__version__", ""), xgr_compile, xgr.GrammarMatcher,
        lambda m: m.fill_next_token_bitmask(bitmask), lambda m, t: m.accept_token(t), info.vocab_size)
except ImportError as ex:
    print(json.dumps({"engine": "xgrammar", "error": str(ex)}))

try:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    lltok = llguidance.hf.from_tokenizer(hf)
    lmask = lln.allocate_token_bitmask(1, lltok.vocab_size)
    text = schema if schema is not None else '{"type": "object"}'

    def llg_compile():
        grm = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        return grm, llguidance.LLMatcher(lltok, grm)

    run("llguidance " + getattr(llguidance, "__version__", ""), llg_compile, lambda g: llguidance.LLMatcher(lltok, g[0]),
        lambda m: lln.fill_next_token_bitmask(m, lmask, 0), lambda m, t: m.consume_token(t), lltok.vocab_size)
except ImportError as ex:
    print(json.dumps({"engine": "llguidance", "error": str(ex)}))
