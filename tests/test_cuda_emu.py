#!/usr/bin/env python3
"""test_cuda_emu.py: the CUDA backend end to end, its own code (batch upload, adapter slots with
their module tables, cuBLAS GEMMs, the paged-attention and grouped-LoRA kernels, the copy and
compute streams) run on the host CUDA emulator (CS_TEST_DEVICE=cuda-emu), against the CPU
backend, on machines without a GPU.

`caraserve batch` runs one workload on both: 3 adapters of ranks 4/8/16 (one with BF16
weights in its slot) and the base model mixed in one batch, prompts of 1-70 tokens sharing
prefixes (the prefix cache), n=3 samples of one prompt (the fork's KV copy), greedy and
seeded sampling, top-5 logprobs, chunked prefill (a 48-token budget), on an F32 Llama (GQA)
and an F32 Qwen2 (q/k/v biases). F32 weights keep the CUDA backend's GEMMs in F32 (no
rounding of activations), so both backends compute the same function in another order:
every token must agree and every logprob within 2e-5 (F32 sums of up to a few hundred
terms in another order; measured differences are printed). Then again with one device slot
for the three adapters (--max-loras 1): slots evicted and uploaded again; and with
--cuda-graphs: decode steps recorded as graphs on their second run and replayed after (the
emulator records and replays the launches, copies and GEMMs), with the same results, and
the counters must show captures and replays.
BF16 models on the CUDA backend round activations to BF16 before a GEMM, as vLLM does; that
path is held against transformers in bfloat16 on a GPU host (tests/test_gpu_ref.py).
On a GPU host tests/test_gpu runs this file with CS_TEST_CUDA_DEVICE=cuda: the same checks
with the real device (--device cuda) in place of the emulator.
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_cuda_emu.py"""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import transformers  # noqa: E402
from hfmodels import make_adapters, make_model, mixed_workload, paired_lines, run_batch  # noqa: E402

transformers.utils.logging.disable_progress_bar()
TOL = 2e-5
REAL = os.environ.get("CS_TEST_CUDA_DEVICE") == "cuda"   # the GPU itself (tests/test_gpu)
NAME = "cuda" if REAL else "cuda-emu"


def run(model_dir, requests, loras, device, extra=()):
    out, stats = run_batch(model_dir, requests, loras,
                           ("--preload-adapters", "--device", "cuda" if device == "cuda" else "cpu", *extra),
                           {"CS_TEST_DEVICE": device} if device == "cuda-emu" else {}, f"device={device}")
    return [json.loads(x) for x in out], stats


def samples(line):
    return line["samples"] if "samples" in line else [line]


def compare(what, cpu, dev):
    """every sample's tokens equal, every logprob (chosen and top-5) within TOL; the largest gap"""
    worst = 0.0
    for a, b in paired_lines(what, cpu, dev):
        for sa, sb in zip(samples(a), samples(b), strict=True):
            if sa.get("tokens") != sb.get("tokens"):
                reflib.fail(f"{what}: request {a['id']}: tokens {sa.get('tokens')} on the CPU, {sb.get('tokens')} on "
                            f"{NAME}")
            la, lb = sa.get("logprobs") or [], sb.get("logprobs") or []
            if len(la) != len(lb) or not la:
                reflib.fail(f"{what}: request {a['id']}: logprobs missing or of another length")
            for pa, pb in zip(la, lb):
                ka, kb = json.dumps(pa, sort_keys=True), json.dumps(pb, sort_keys=True)
                fa, fb = flatten(pa), flatten(pb)
                if len(fa) != len(fb):
                    reflib.fail(f"{what}: request {a['id']}: logprob entries differ in shape:\n {ka[:300]}\n {kb[:300]}")
                for x, y in zip(fa, fb):
                    if isinstance(x, float) or isinstance(y, float):
                        d = abs(x - y)
                        worst = max(worst, d)
                        if d > TOL:
                            reflib.fail(f"{what}: request {a['id']}: logprob {x} vs {y} (|d| = {d:.3g} > {TOL})")
                    elif x != y:
                        reflib.fail(f"{what}: request {a['id']}: {x} vs {y} in\n {ka[:300]}\n {kb[:300]}")
    return worst


def flatten(v):
    if isinstance(v, dict):
        return [y for k in sorted(v) for y in [k] + flatten(v[k])]
    if isinstance(v, list):
        return [y for x in v for y in flatten(x)]
    return [v]


rng = random.Random(5)
for kind, kv_heads in (("llama", 2), ("qwen2", 4)):
    model_dir, ref = make_model(kind, dtype="float32", kv_heads=kv_heads, seed=13)
    loras = make_adapters(model_dir, ref, (4, 8, 16), seed=60, dtypes=("float32", "bfloat16", "float32"))
    reqs = mixed_workload(rng, [n for n, _ in loras], max_tokens=8)
    cpu, _ = run(model_dir, reqs, loras, None)
    dev, st = run(model_dir, reqs, loras, NAME)
    worst = compare(f"{kind}", cpu, dev)
    be = st.get("backend", {})
    if be.get("name") != NAME or not be.get("batch_uploads") or not be.get("h2d_bytes") or not be.get("d2d_bytes"):
        reflib.fail(f"{kind}: the emulated CUDA backend's stats do not show it ran: {be}")
    n_samples = sum(len(samples(x)) for x in cpu)
    print(f"ok  {kind} f32: {len(reqs)} requests ({n_samples} samples, 3 adapters + base) on {NAME}: same tokens, "
          f"logprobs within {worst:.2g} of the CPU backend's; {be['batch_uploads']} batch uploads, "
          f"{be['h2d_bytes']} bytes in, {be['d2d_bytes']} device to device")
    cpu1, _ = run(model_dir, reqs, loras, None, extra=("--max-loras", "1"))
    dev1, st1 = run(model_dir, reqs, loras, NAME, extra=("--max-loras", "1"))
    worst1 = compare(f"{kind} --max-loras 1", cpu1, dev1)
    if not st1.get("lora_device_evictions") or not st1.get("lora_device_waits"):
        reflib.fail(f"{kind}: --max-loras 1 did not make slots wait and evict: {st1}")
    print(f"ok  {kind} --max-loras 1: {st1['lora_device_uploads']} slot uploads, {st1['lora_device_evictions']} "
          f"evictions on {NAME}; logprobs within {worst1:.2g}")
    dev2, st2 = run(model_dir, reqs, loras, NAME, extra=("--cuda-graphs", "--max-num-seqs", "4"))
    cpu2, _ = run(model_dir, reqs, loras, None, extra=("--max-num-seqs", "4"))
    worst2 = compare(f"{kind} --cuda-graphs", cpu2, dev2)
    be2 = st2.get("backend", {})
    if not be2.get("graph_captures") or not be2.get("graph_replays"):
        reflib.fail(f"{kind}: --cuda-graphs recorded or replayed no graph: {be2}")
    print(f"ok  {kind} --cuda-graphs: {be2['graph_captures']} decode graphs recorded, {be2['graph_replays']} replays "
          f"on {NAME}; same tokens, logprobs within {worst2:.2g}")
print("PASS")
