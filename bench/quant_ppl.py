"""bench/quant_ppl.py CARASERVE MODEL TEXT N_CTX CHUNKS THREADS [PRECISION]: perplexity of MODEL on TEXT the way
llama.cpp's llama-perplexity computes it: the text tokenized by the model's own tokenizer (BOS
added where the tokenizer adds it), cut into chunks of N_CTX tokens, the first token of each
chunk replaced by BOS, the second half of each chunk scored (positions N_CTX/2 .. N_CTX-2
predicting the next token), PPL = exp(mean NLL). Prints the PPL."""
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

exe, model, text_path, n_ctx, chunks, threads = sys.argv[1:7]
prec = sys.argv[7] if len(sys.argv) > 7 else "exact"
n_ctx, chunks = int(n_ctx), int(chunks)
text = open(text_path, encoding="utf-8").read()
p = subprocess.run([exe, "generate", "--model", model, "--prompt", text, "--max-tokens", "0", "--print-ids",
                    "--threads", threads], capture_output=True, text=True)
if p.returncode:
    sys.exit(f"{exe} generate: {p.stderr}")
ids = next(l for l in p.stdout.splitlines() if l.startswith("prompt_ids:")).split(":", 1)[1].strip()
ids = [int(t) for t in ids.split(",")]
bos = ids[0]  # the tokenizer adds BOS (both test models do); llama-perplexity puts it first in every chunk
n = min(chunks, len(ids) // n_ctx)
if n < 1:
    sys.exit(f"{len(ids)} tokens: fewer than one chunk of {n_ctx}")
nll, count = 0.0, 0
with tempfile.TemporaryDirectory() as tmp:
    dump = os.path.join(tmp, "logits.bin")
    for c in range(n):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        chunk[0] = bos
        p = subprocess.run([exe, "generate", "--model", model, "--prompt-ids", ",".join(map(str, chunk)),
                            "--max-tokens", "0", "--dump-logits", dump, "--threads", threads, "--precision", prec],
                           capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"{exe} generate: {p.stderr}")
        with open(dump, "rb") as f:
            _, rows, vocab = struct.unpack("<3i", f.read(12))
            logits = np.frombuffer(f.read(), dtype=np.float32).reshape(rows, vocab).astype(np.float64)
        for i in range(n_ctx // 2, n_ctx - 1):
            row = logits[i]
            m = row.max()
            lse = m + math.log(np.exp(row - m).sum())
            nll += lse - row[chunk[i + 1]]
            count += 1
print(f"{math.exp(nll / count):.6f}")
