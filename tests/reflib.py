"""reflib.py: shared helpers for the reference tests. Checkpoints are written by
transformers' and peft's own save_pretrained (random weights, real formats), the C engine
runs through `caraserve generate --dump-logits`, and transformers + peft on CPU torch in
float32 are the truth it is compared against."""
import atexit
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

SRCDIR = os.environ.get("CS_SRCDIR", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILDDIR = os.environ.get("CS_BUILDDIR", os.path.join(SRCDIR, "build"))
CARASERVE = os.path.join(BUILDDIR, "caraserve")
MKMODEL = os.path.join(BUILDDIR, "caraserve-mkmodel")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Every temporary file of a test, its own and its children's (TMPDIR: a server killed with
# SIGKILL cannot remove its upload directory), lives under one directory that is removed when
# the test passes and kept, with its path printed, when it fails (CS_KEEP_TMP=1 keeps it always).
_TMPROOT = tempfile.mkdtemp(prefix="cs_test_")
tempfile.tempdir = _TMPROOT
os.environ["TMPDIR"] = _TMPROOT
_keep_tmp = bool(os.environ.get("CS_KEEP_TMP"))


def _cleanup_tmp():
    if _keep_tmp:
        print(f"(temporary files kept in {_TMPROOT})")
    else:
        shutil.rmtree(_TMPROOT, ignore_errors=True)


atexit.register(_cleanup_tmp)
_excepthook = sys.excepthook


def _on_uncaught(*exc):
    global _keep_tmp
    _keep_tmp = True
    _excepthook(*exc)


sys.excepthook = _on_uncaught


def fail(msg):
    global _keep_tmp
    _keep_tmp = True
    print("FAIL:", msg)
    sys.exit(1)


def tmpdir(prefix):
    return tempfile.mkdtemp(prefix=prefix)


def read_logits(path):
    with open(path, "rb") as f:
        magic, rows, vocab = struct.unpack("<3i", f.read(12))
        if magic != 0x474C5343:
            fail(f"{path}: bad logits dump magic")
        data = np.frombuffer(f.read(), dtype=np.float32)
    if data.size != rows * vocab:
        fail(f"{path}: {data.size} floats for {rows}x{vocab}")
    return data.reshape(rows, vocab)


def log_softmax64(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def run_engine(model_dir, prompt_ids, max_tokens, lora_dir=None, threads=2, extra=()):
    """Returns (logits rows for prompt positions + each decode step, generated ids)."""
    dump = tempfile.mktemp(prefix="cs_logits_", suffix=".bin")
    cmd = [CARASERVE, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt_ids)),
           "--max-tokens", str(max_tokens), "--ignore-eos", "--print-ids", "--dump-logits", dump,
           "--threads", str(threads), *extra]
    if lora_dir:
        cmd += ["--lora", lora_dir]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr}")
    gen = []
    for line in p.stdout.splitlines():
        if line.startswith("generated_ids:"):
            rest = line.split(":", 1)[1].strip()
            gen = [int(t) for t in rest.split(",")] if rest else []
    rows = read_logits(dump)
    os.unlink(dump)
    return rows, gen


def hf_logits(model, ids):
    import torch
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long))
    return out.logits[0].double().numpy()


def compare(name, model_ref, model_dir, prompt_ids, max_tokens, tol, lora_dir=None, threads=2, extra=(), held=None):
    """C engine vs transformers: every position's log-softmax, and the greedy continuation
    (a divergence is only accepted where transformers' own top-2 logits tie within 1e-4).
    extra: more flags for `caraserve generate`. held: called after the reference's forward,
    returns (n, loose): only the first n positions are held to tol, the rest to loose."""
    rows, gen = run_engine(model_dir, prompt_ids, max_tokens, lora_dir, threads, extra)
    full = list(prompt_ids) + gen
    ref = hf_logits(model_ref, full[:-1] if gen else full)
    if rows.shape[0] != ref.shape[0]:
        fail(f"{name}: engine gave {rows.shape[0]} rows, reference {ref.shape[0]}")
    lp, lr = log_softmax64(rows), log_softmax64(ref)
    err = np.abs(lp - lr)
    n_held, note = len(full), ""
    if held is not None:  # positions from n_held on: within loose, not tol
        n_held, loose = held()
        n_held = min(n_held, err.shape[0])
        if n_held < 1:
            fail(f"{name}: no position is held to {tol}")
        rest = float(err[n_held:].max()) if n_held < err.shape[0] else 0.0
        if not rest <= loose:
            fail(f"{name}: max |logprob diff| {rest:.3g} > {loose} after position {n_held}")
        note = f" on positions 0-{n_held - 1}, {rest:.2e} (bound {loose}) after"
        err = err[:n_held]
    worst = float(err.max())
    pos = int(err.max(axis=1).argmax())
    if not worst <= tol:
        fail(f"{name}: max |logprob diff| {worst:.3g} > {tol} at position {pos} of {len(full)}")
    n_prompt = len(prompt_ids)
    agreed = 0
    for k, tok in enumerate(gen):
        if n_prompt - 1 + k >= n_held:
            break  # not held to tol from here on
        r = ref[n_prompt - 1 + k]
        top2 = np.sort(r)[-2:]
        want = int(r.argmax())
        if tok != want:
            if top2[1] - top2[0] < 1e-4:
                break  # a genuine tie in the reference: either token is greedy
            fail(f"{name}: greedy token {k} is {tok}, transformers says {want} (margin {top2[1]-top2[0]:.3g})")
        agreed += 1
    print(f"ok  {name}: {len(prompt_ids)} prompt + {len(gen)} generated tokens, max |dlogprob| {worst:.2e} "
          f"(tol {tol}){note}, greedy agrees on {agreed}/{len(gen)}")
    return worst
