"""bench/quant_greedy.py CARASERVE LLAMA MODEL TOKENS THREADS: greedy continuations of a set of prompts
by llama.cpp (LLAMA: its llama-completion, run with an F32 KV cache as caraserve's, or llama-simple,
whose KV cache is F16) and by `caraserve generate` (--precision int8 and exact) on the same GGUF
file, compared as text. Prints one JSON object: per prompt the three texts, whether each of ours
equals llama.cpp's, and the characters they share from the start.

Where they may legitimately part: llama.cpp multiplies quantized weights by activations quantized
to 8 bits (Q8_0/Q8_1/Q8_K blocks) and sums in its own order; --precision int8 does the same
arithmetic, but rounding to 8 bits is a step function: two F32 computations of one activation an
ulp apart (another order of sums in attention or in a matmul, x * (127 / max) against llama.cpp's
x * (1 / (max / 127)), ties to even against away from zero) can round it a whole step apart, and
a step moves later logprobs by up to about 0.1 (a 135M model). Greedy choices whose margin is
below that can turn, and once one token differs the text follows another context. exact runs on
the F32 activations, a larger difference (the 8-bit quantization's own), so it turns earlier."""
import json
import os
import subprocess
import sys

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


def ours(exe, model, prompt, tokens, threads, prec):
    p = subprocess.run([exe, "generate", "--model", model, "--prompt", prompt, "--max-tokens", str(tokens),
                        "--threads", threads, "--precision", prec],
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        sys.exit(f"{exe} generate: {p.stderr}")
    out = p.stdout
    return out[:-1] if out.endswith("\n") else out


def llama(exe, model, prompt, tokens, threads):
    if "completion" in os.path.basename(exe):
        cmd = [exe, "-m", model, "-p", prompt, "-n", str(tokens), "--temp", "0", "-ctk", "f32", "-ctv", "f32", "-t", threads,
               "-no-cnv", "--no-warmup", "--simple-io"]
    else:
        cmd = [exe, "-m", model, "-n", str(tokens), prompt]
    p = subprocess.run(cmd, capture_output=True, timeout=600)
    if p.returncode:
        sys.exit(f"{exe}: {p.stderr.decode(errors='replace')[-2000:]}")
    out = p.stdout.decode("utf-8", errors="replace")
    if not out.startswith(prompt):
        sys.exit(f"{exe}: output does not begin with the prompt: {out[:200]!r}")
    out = out[len(prompt):]
    return out[:-1] if out.endswith("\n") else out


def shared(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    exe, simple, model, tokens, threads = sys.argv[1:6]
    res = {"model": model, "llama_cpp": os.path.basename(simple), "tokens": int(tokens), "prompts": []}
    for pr in PROMPTS:
        ref = llama(simple, model, pr, tokens, threads)
        row = {"prompt": pr, "llama_cpp": ref}
        for prec in ("int8", "exact"):
            t = ours(exe, model, pr, tokens, threads, prec)
            # llama-simple prints what it generated up to its last token; generate may end with
            # a newline of its own: compare the llama.cpp text's length
            row[prec] = t
            row[prec + "_equal"] = t.rstrip("\n") == ref.rstrip("\n")
            row[prec + "_shared_chars"] = shared(t, ref)
        res["prompts"].append(row)
    for prec in ("int8", "exact"):
        res[prec + "_equal"] = sum(r[prec + "_equal"] for r in res["prompts"])
    res["n_prompts"] = len(PROMPTS)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
