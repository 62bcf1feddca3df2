"""bench/quant_ppl.py CARASERVE LLAMA_PERPLEXITY MODEL TEXT N_CTX CHUNKS THREADS: perplexity of the GGUF MODEL
on TEXT by llama.cpp's llama-perplexity (with an F32 KV cache, as caraserve's) and by caraserve
(--precision int8 and exact) on the same tokens, and how far caraserve's next-token distributions
are from llama.cpp's at every scored position.

llama-perplexity tokenizes TEXT, cuts it into chunks of N_CTX tokens, puts BOS first in each chunk
where the model adds BOS, scores the second half of each chunk (positions N_CTX/2 .. N_CTX-2
predicting the next token) and, with --kl-divergence-base, saves those positions' log-probabilities
(16 bits each, a step of at most 16/65535 between the top and 16 below it). caraserve runs the
same tokens (`generate --prompt-ids --dump-logits`): --precision int8, exact, and int8 with
--batch-invariant. Per run: PPL = exp(mean NLL), the mean
and largest KL divergence KL(llama.cpp || caraserve) (over the tokens within 16 of the top), the share of positions where both put the
same token on top, the RMS of the difference in the probability of the scored token, and the
largest difference in its log-probability (where llama.cpp's is within 16 of the top); and the same
KL divergence and top-token share between caraserve's two int8 runs. Prints one JSON object.

Rounding activations to 8 bits is a step function: two computations an F32 ulp apart can round a
value a step apart, that step moves everything after it by more than an ulp, and the next layer's
roundings part further. Two int8 runs whose F32 sums differ only in their order (llama.cpp's and
caraserve's; caraserve's own with and without --batch-invariant) end up about as far apart as
int8 is from the unrounded activations: int8_vs_int8_invariant is that yardstick."""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import gguf
import numpy as np


def llama_logits(exe, model, text_path, n_ctx, chunks, threads, path):
    """llama-perplexity's PPL, and its saved tokens and scored log-probabilities"""
    p = subprocess.run([exe, "-m", model, "-f", text_path, "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(chunks),
                        "-t", threads, "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", path],
                       capture_output=True, text=True, timeout=1800)
    ppl = [l for l in (p.stdout + p.stderr).splitlines() if "Final estimate: PPL" in l]
    if p.returncode or not ppl:
        sys.exit(f"{exe}: {(p.stdout + p.stderr)[-2000:]}")
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            sys.exit(f"{path}: not llama-perplexity's log-probabilities")
        ctx, vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        tokens = np.frombuffer(f.read(4 * ctx * n_chunk), dtype=np.int32).reshape(n_chunk, ctx)
        nv = 2 * ((vocab + 1) // 2) + 4
        rows = ctx - 1 - ctx // 2
        raw = np.frombuffer(f.read(), dtype=np.uint16)
    if raw.size != n_chunk * rows * nv or ctx != n_ctx:
        sys.exit(f"{path}: {raw.size} log-probabilities, {n_chunk} x {rows} x {nv} expected")
    raw = raw.reshape(n_chunk, rows, nv)
    head = raw[:, :, :4].copy().view(np.float32)  # per row: scale, the log-probability of q = 0
    lp = head[:, :, 1:2].astype(np.float64) + head[:, :, 0:1].astype(np.float64) * raw[:, :, 4:4 + vocab]
    # a log-probability more than 16 below the top is coded 0: held as that bound, left out of
    # the largest difference
    return float(ppl[-1].split("PPL =")[1].split()[0]), tokens, lp, raw[:, :, 4:4 + vocab] > 0


# caraserve's runs: int8, exact, and int8 again with --batch-invariant (other F32 sum orders in its
# matmuls, the same 8-bit arithmetic): how far two of caraserve's own int8 runs part
RUNS = {"int8": ["--precision", "int8"], "exact": ["--precision", "exact"],
        "int8_invariant": ["--precision", "int8", "--batch-invariant"]}


def ours(exe, model, chunk, threads, run, dump):
    p = subprocess.run([exe, "generate", "--model", model, "--prompt-ids", ",".join(map(str, chunk)),
                        "--max-tokens", "0", "--dump-logits", dump, "--threads", threads] + RUNS[run],
                       capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{exe} generate: {p.stderr}")
    with open(dump, "rb") as f:
        _, rows, vocab = struct.unpack("<3i", f.read(12))
        return np.frombuffer(f.read(), dtype=np.float32).reshape(rows, vocab).astype(np.float64)


def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main():
    exe, perplexity, model, text_path, n_ctx, chunks, threads = sys.argv[1:8]
    n_ctx, chunks = int(n_ctx), int(chunks)
    r = gguf.GGUFReader(model)
    f = r.fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(f.parts[-1][0]) if f else True
    bos = int(r.fields["tokenizer.ggml.bos_token_id"].parts[-1][0]) if add_bos else None
    with tempfile.TemporaryDirectory() as tmp:
        lppl, tokens, lref, coded = llama_logits(perplexity, model, text_path, n_ctx, chunks, threads, os.path.join(tmp, "base.kld"))
        res = {"model": model, "n_ctx": n_ctx, "chunks": int(tokens.shape[0]), "positions": int(lref.shape[0] * lref.shape[1]),
               "llama_cpp_ppl": lppl}
        first = n_ctx // 2
        pref = np.exp(lref)
        int8 = []
        for prec in RUNS:
            nll, kld, same, dp2, dlp, kself, sself = [], [], [], [], [], [], []
            for c in range(tokens.shape[0]):
                chunk = [int(t) for t in tokens[c]]
                if add_bos:
                    chunk[0] = bos
                lo = log_softmax(ours(exe, model, chunk, threads, prec, os.path.join(tmp, "logits.bin"))[first:n_ctx - 1])
                if prec == "int8":
                    int8.append(lo)
                elif prec == "int8_invariant":
                    kself.append((np.exp(int8[c]) * (int8[c] - lo)).sum(axis=-1))
                    sself.append(lo.argmax(axis=-1) == int8[c].argmax(axis=-1))
                nxt = np.array(chunk[first + 1:n_ctx])
                idx = np.arange(len(nxt))
                nll.append(-lo[idx, nxt])
                kld.append(np.where(coded[c], pref[c] * (lref[c] - lo), 0).sum(axis=-1))
                same.append(lo.argmax(axis=-1) == lref[c].argmax(axis=-1))
                dp2.append((np.exp(lo[idx, nxt]) - pref[c][idx, nxt]) ** 2)
                dlp.append(np.where(coded[c][idx, nxt], np.abs(lo[idx, nxt] - lref[c][idx, nxt]), 0))
            nll, kld, same, dp2, dlp = (np.concatenate(v) for v in (nll, kld, same, dp2, dlp))
            res[prec] = {"ppl": float(math.exp(nll.mean())), "ppl_ratio": float(math.exp(nll.mean())) / lppl,
                         "kld_mean": float(kld.mean()), "kld_max": float(kld.max()), "same_top": float(same.mean()),
                         "rms_dp": float(math.sqrt(dp2.mean())), "max_dlogprob": float(dlp.max())}
            if kself:
                res["int8_vs_int8_invariant"] = {"kld_mean": float(np.concatenate(kself).mean()),
                                                 "same_top": float(np.concatenate(sself).mean())}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
