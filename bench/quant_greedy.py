"""bench/quant_greedy.py CARASERVE LLAMA MODEL TOKENS THREADS: greedy continuations of a set of prompts
by llama.cpp (LLAMA: its llama-completion, run with an F32 KV cache as caraserve's, or llama-simple,
whose KV cache is F16) and by `caraserve batch` (--precision int8 and exact, and int8 with
--batch-invariant) on the same GGUF file, compared as text. Prints one JSON object: per prompt the three texts, whether each of ours equals
llama.cpp's, the characters they share from the start, and where they part: the token at which
ours leaves llama.cpp's text, our log-probabilities there of our token and of the candidates that
continue llama.cpp's text (from our top 5), and the margin between them; and the same between
caraserve's two int8 runs (int8_self_*).

Where they may legitimately part: llama.cpp multiplies quantized weights by activations quantized
to 8 bits (Q8_0/Q8_1/Q8_K blocks) and sums in its own order; --precision int8 does the same
arithmetic with the same activation blocks and scales, but rounding to 8 bits is a step function:
two F32 computations of one activation an ulp apart (another order of sums in attention or in a
matmul, its double-precision RMSNorm sums, its own exp) can round it a whole step apart, and a
step moves later logprobs by up to about 0.1 (a 135M model). Greedy choices whose margin is
below that can turn, and once one token differs the text follows another context. exact runs on
the F32 activations, a larger difference (the 8-bit quantization's own), so it turns earlier.
The margin at the parting token says which case it is: a near tie in our own log-probabilities.
caraserve's int8 with and without --batch-invariant (the same 8-bit arithmetic, other F32 sum
orders) part the same way: how often, and at what margins, is the yardstick."""
import json
import os
import subprocess
import sys
import tempfile

import gguf

EOG_MARK = " [end of text]\n"
TOP = 5

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "In 1969, the first humans",
]


def token_bytes(model):
    """each token id's bytes as a continuation prints them (GPT-2 byte-level BPE or SentencePiece);
    control tokens print nothing"""
    r = gguf.GGUFReader(model)
    f = r.fields["tokenizer.ggml.tokens"]
    toks = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    t = r.fields.get("tokenizer.ggml.token_type")
    types = [int(t.parts[i][0]) for i in t.data] if t else [1] * len(toks)
    kind = bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode()
    out = []
    if kind == "gpt2":
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        dec = {chr(c): b for b, c in zip(bs, cs)}
        for s, ty in zip(toks, types):
            out.append(b"" if ty == 3 else bytes(dec[ch] for ch in s) if all(ch in dec for ch in s) else s.encode())
    else:
        for s, ty in zip(toks, types):
            if ty == 3:
                out.append(b"")
            elif ty == 6 and s.startswith("<0x"):
                out.append(bytes([int(s[3:5], 16)]))
            else:
                out.append(s.replace("\u2581", " ").encode())
    return out


# caraserve's runs: int8, exact, and int8 again with --batch-invariant (other F32 sum orders, the
# same 8-bit arithmetic): how often two of caraserve's own int8 runs part, the yardstick
RUNS = {"int8": ["--precision", "int8"], "exact": ["--precision", "exact"],
        "int8_invariant": ["--precision", "int8", "--batch-invariant"]}


def ours(exe, model, tokens, threads, run):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for pr in PROMPTS:
            f.write(json.dumps({"prompt": pr, "max_tokens": int(tokens), "temperature": 0, "logprobs": TOP}) + "\n")
        path = f.name
    try:
        p = subprocess.run([exe, "batch", "--model", model, "--requests", path, "--threads", threads] + RUNS[run],
                           capture_output=True, text=True, timeout=1200)
    finally:
        os.unlink(path)
    if p.returncode:
        sys.exit(f"{exe} batch: {p.stderr}")
    return [json.loads(line)["samples"][0] for line in p.stdout.splitlines() if line.startswith("{")]


def llama(exe, model, prompt, tokens, threads):
    """llama.cpp's continuation and whether it ended on an end-of-generation token"""
    if "completion" in os.path.basename(exe):
        cmd = [exe, "-m", model, "-p", prompt, "-n", str(tokens), "--temp", "0", "-ctk", "f32", "-ctv", "f32", "-t", threads,
               "-no-cnv", "--no-warmup", "--simple-io"]
    else:
        cmd = [exe, "-m", model, "-n", str(tokens), prompt]
    p = subprocess.run(cmd, capture_output=True, timeout=600)
    if p.returncode:
        sys.exit(f"{exe}: {p.stderr.decode(errors='replace')[-2000:]}")
    out = p.stdout
    if not out.startswith(prompt.encode()):
        sys.exit(f"{exe}: output does not begin with the prompt: {out[:200]!r}")
    out = out[len(prompt.encode()):]
    # llama-completion ends its output with two newlines of its own, and marks the end of
    # generation (an end-of-generation token) before them; caraserve stops there and prints
    # nothing: compare the text before the mark (llama-simple ends with one newline)
    tail = b"\n\n" if "completion" in os.path.basename(exe) else b"\n"
    out = out[:-len(tail)] if out.endswith(tail) else out
    if out.endswith(EOG_MARK.encode()):
        return out[:-len(EOG_MARK)], True
    return out, False


def shared(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parting(sample, ref, ref_eog, tb):
    """where our tokens leave llama.cpp's text REF (bytes): the token's index, our top log-probability
    there, the best of our top candidates that continue REF (or end it, where llama.cpp ended), the
    margin between the two; None where ours is REF"""
    acc = b""
    toks, tops = sample["tokens"], sample["top_logprobs"]
    for k, t in enumerate(toks):
        rest = ref[len(acc):]
        b = tb[t]
        ended = sample["finish_reason"] == "stop" and k == len(toks) - 1
        if (b and rest.startswith(b)) or (not b and not ended):
            acc += b
            continue
        if ended and not b and not rest:
            return None
        cands = [(i, lp) for i, lp in tops[k] if (tb[i] and rest.startswith(tb[i])) or (not rest and ref_eog and not tb[i])]
        best = max(cands, key=lambda c: c[1]) if cands else None
        top = max(lp for _, lp in tops[k])
        return {"token": k, "ours": t, "ours_logprob": top, "llama_cpp_candidate": best[0] if best else None,
                "candidate_logprob": best[1] if best else None, "margin": top - best[1] if best else None,
                "margin_at_least": top - min(lp for _, lp in tops[k])}
    return None


def main():
    exe, simple, model, tokens, threads = sys.argv[1:6]
    tb = token_bytes(model)
    res = {"model": model, "llama_cpp": os.path.basename(simple), "tokens": int(tokens), "prompts": []}
    refs = [llama(simple, model, pr, tokens, threads) for pr in PROMPTS]
    runs = {run: ours(exe, model, tokens, threads, run) for run in RUNS}
    for i, pr in enumerate(PROMPTS):
        ref, eog = refs[i]
        row = {"prompt": pr, "llama_cpp": ref.decode("utf-8", errors="replace"), "llama_cpp_eog": eog}
        for prec in ("int8", "exact"):
            s = runs[prec][i]
            t = b"".join(tb[x] for x in s["tokens"])
            row[prec] = t.decode("utf-8", errors="replace")
            row[prec + "_equal"] = t == ref
            row[prec + "_shared_chars"] = len(ref[:shared(t, ref)].decode("utf-8", errors="ignore"))
            row[prec + "_parts"] = parting(s, ref, eog, tb)
        a, b = runs["int8"][i], runs["int8_invariant"][i]
        mine = b"".join(tb[x] for x in a["tokens"])
        row["int8_invariant"] = b"".join(tb[x] for x in b["tokens"]).decode("utf-8", errors="replace")
        row["int8_invariant_equal_int8"] = a["tokens"] == b["tokens"]
        row["int8_invariant_parts_from_int8"] = parting(b, mine, a["finish_reason"] == "stop", tb)
        res["prompts"].append(row)
    for prec in ("int8", "exact"):
        res[prec + "_equal"] = sum(r[prec + "_equal"] for r in res["prompts"])
        m = [r[prec + "_parts"] for r in res["prompts"] if r[prec + "_parts"]]
        res[prec + "_margins"] = [p["margin"] for p in m]
        # where llama.cpp's token is not in our top TOP, the margin is at least the top's spread
        res[prec + "_max_margin"] = max((p["margin"] if p["margin"] is not None else p["margin_at_least"] for p in m),
                                        default=None)
        res[prec + "_outside_top"] = sum(p["margin"] is None for p in m)
    m = [r["int8_invariant_parts_from_int8"] for r in res["prompts"] if r["int8_invariant_parts_from_int8"]]
    res["int8_self_equal"] = sum(r["int8_invariant_equal_int8"] for r in res["prompts"])
    res["int8_self_margins"] = [p["margin"] for p in m]
    res["n_prompts"] = len(PROMPTS)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
