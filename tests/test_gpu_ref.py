#!/usr/bin/env python3
"""test_gpu_ref.py: the CUDA backend's BF16 path against transformers + peft in bfloat16, the
way vLLM serves a BF16 model: weights in BF16, activations rounded to BF16 at every GEMM,
F32 accumulation.

A BF16 Llama (GQA) and a BF16 Qwen2 (q/k/v biases), 3 BF16 adapters of ranks 8/16/32 and the
base model in one `caraserve batch`, greedy and seeded requests with top-5 logprobs, with an
F32 KV cache and again with a BF16 one (--kv-cache-dtype bf16, what a BF16 model's cache holds
in transformers too): the same bars for both. Each
request's tokens are teacher-forced through transformers (+ peft) in bfloat16 and in float32
on the same weights; the logprob of every generated token and of its top-5 alternatives is
compared. The yardstick is transformers' own BF16 noise, floor = max |transformers bf16 -
transformers fp32| over the same logprobs: caraserve must be no noisier than transformers'
bf16 (|caraserve - fp32| <= floor: it rounds only the GEMM inputs and keeps its residual
stream in F32), and so, by the triangle inequality, within 2 x floor of transformers bf16;
its greedy tokens must be transformers-bf16's argmax unless those two tie within the noise.

Where: with CS_TEST_CUDA_DEVICE=cuda (tests/test_gpu sets it on a GPU host: a CUDA build, a
visible GPU, torch with CUDA) caraserve runs with --device cuda and transformers on the same
GPU. Elsewhere (make check on every machine) the same checks run with the CUDA backend's
code on the host emulator (CS_TEST_DEVICE=cuda-emu) against transformers on the CPU, in
bfloat16 too.
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_gpu_ref.py"""
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import VOCAB, make_adapters, make_model  # noqa: E402
from peft import PeftModel  # noqa: E402

transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(2)


REAL = os.environ.get("CS_TEST_CUDA_DEVICE") == "cuda"   # tests/test_gpu sets it on a GPU host
TORCH_DEV = "cuda" if REAL else "cpu"
WHERE = "the GPU (--device cuda, transformers on cuda)" if REAL else \
    "the CUDA emulator (cuda-emu), transformers on the CPU"


def run(model_dir, requests, loras, extra=()):
    path = os.path.join(reflib.tmpdir("cs_gpuref_"), "requests.jsonl")
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    cmd = [reflib.CARASERVE, "batch", "--model", model_dir, "--requests", path, "--threads", "2",
           "--kv-cache-bytes", "16M", "--preload-adapters", "--device", "cuda" if REAL else "cpu", *extra]
    for name, d in loras:
        cmd += ["--lora", f"{name}={d}"]
    env = dict(os.environ)
    env.pop("CS_TEST_DEVICE", None)
    if not REAL:
        env["CS_TEST_DEVICE"] = "cuda-emu"
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        reflib.fail(f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}")
    return [json.loads(x) for x in p.stdout.splitlines()]


def logprobs(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long, device=TORCH_DEV))
    return reflib.log_softmax64(out.logits[0].double().cpu().numpy())


def load(model_dir, adapter_dir, dtype):
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype,
                                                         attn_implementation="eager").to(TORCH_DEV).eval()
    if adapter_dir:
        m = PeftModel.from_pretrained(m, adapter_dir).to(TORCH_DEV).eval()
    return m


def check(kind, kv, model_dir, loras, reqs, out, refs):
    """every generated token's logprob and top-5 against transformers bf16 and fp32 (the bars
    below); refs caches the reference models per adapter"""
    worst_cs, worst_cs32, worst_floor, n_tok = 0.0, 0.0, 0.0, 0
    for req, line in zip(reqs, out):
        a = req.get("adapter")
        adir = dict(loras)[a] if a else None
        if a not in refs:
            refs[a] = (load(model_dir, adir, torch.bfloat16), load(model_dir, adir, torch.float32))
        m16, m32 = refs[a]
        s = line["samples"][0] if "samples" in line else line
        toks = s["tokens"]
        full = req["prompt_ids"] + toks
        lp16, lp32 = logprobs(m16, full[:-1]), logprobs(m32, full[:-1])
        d_cs = d_cs32 = d_floor = 0.0
        for k, t in enumerate(toks):
            row16, row32 = lp16[len(req["prompt_ids"]) - 1 + k], lp32[len(req["prompt_ids"]) - 1 + k]
            pairs = [(t, s["logprobs"][k])] + [(tid, tlp) for tid, tlp in s["top_logprobs"][k]]
            for tid, v in pairs:
                d_cs = max(d_cs, abs(v - row16[tid]))
                d_cs32 = max(d_cs32, abs(v - row32[tid]))
                d_floor = max(d_floor, abs(row32[tid] - row16[tid]))
        worst_cs, worst_cs32 = max(worst_cs, d_cs), max(worst_cs32, d_cs32)
        worst_floor, n_tok = max(worst_floor, d_floor), n_tok + len(toks)
        # greedy: caraserve's token is bf16's argmax, unless bf16's top two are within the noise
        if req["temperature"] == 0:
            for k, t in enumerate(toks):
                row16 = lp16[len(req["prompt_ids"]) - 1 + k]
                top = np.sort(row16)[-2:]
                if t != int(row16.argmax()) and top[1] - top[0] > 2 * max(d_floor, 1e-3):
                    reflib.fail(f"{kind}, {kv} KV, request {req['id']}: greedy token {k} is {t}, transformers bf16 says "
                                f"{int(row16.argmax())} (margin {top[1] - top[0]:.3g})")
                if t != int(row16.argmax()):
                    break  # a tie within the noise: the continuations part here
    # the bar: no noisier than transformers' own bf16 (floor), and so within 2 x floor of it
    if not worst_cs32 <= worst_floor:
        reflib.fail(f"{kind}, {kv} KV: |caraserve - transformers fp32| reaches {worst_cs32:.3g}, more than transformers "
                    f"bf16's own distance {worst_floor:.3g} on the same tokens")
    if not worst_cs <= 2 * worst_floor:
        reflib.fail(f"{kind}, {kv} KV: |caraserve - transformers bf16| reaches {worst_cs:.3g} > 2 x {worst_floor:.3g}")
    print(f"ok  {kind} bf16, {kv.upper()} KV cache, on {WHERE}: {len(reqs)} requests, {n_tok} tokens: "
          f"|caraserve - transformers bf16| <= {worst_cs:.3g} (bar 2 x {worst_floor:.3g}), |caraserve - transformers fp32| <= {worst_cs32:.3g} "
          f"(bar: transformers bf16's own {worst_floor:.3g})")


rng = random.Random(11)
total = 0
for kind, kv_heads in (("llama", 2), ("qwen2", 4)):
    model_dir, ref32 = make_model(kind, dtype="bfloat16", kv_heads=kv_heads, seed=17)
    loras = make_adapters(model_dir, ref32, (8, 16, 32), seed=70, dtypes=("bfloat16",) * 3)
    reqs = []
    for i in range(12):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 60))]
        r = {"id": i, "prompt_ids": prompt, "max_tokens": 8, "logprobs": 5, "ignore_eos": True,
             "temperature": 0 if i % 2 == 0 else 1.0, "seed": 300 + i}
        if i % 4 < 3:
            r["adapter"] = f"a{i % 4}"
        reqs.append(r)
    refs = {}
    for kv in ("f32", "bf16"):
        check(kind, kv, model_dir, loras, reqs, run(model_dir, reqs, loras, ("--kv-cache-dtype", kv)), refs)
    total += 1
print(f"PASS: {total} models")
