#!/usr/bin/env python3
"""test_strict_device.py: the engine on the strict test device (CS_TEST_DEVICE=strict: every
buffer behind a checked handle, fresh memory NaN, copies over its own copy thread) gives the
CPU backend's results to the bit: the same kernels run, so any difference means a host
pointer, an unwritten buffer or a missed copy crossed the interface.

`caraserve batch` runs one workload on both: 3 adapters of ranks 4/8/16 and the base model
mixed in one batch, prompts of 1-70 tokens sharing prefixes (the prefix cache), n=3 samples
of one prompt (the fork's copy-on-write KV copy), greedy and seeded sampling, top-5
logprobs, chunked prefill (a 48-token budget), on an F32 Llama (GQA) and a BF16 Qwen2
(q/k/v biases); one adapter is BF16 (held in BF16 in its slot). Every line of output must be
identical text (jansson prints 17 digits, so equal text is equal float bits); the strict
device's --stats must show its copies. Then again with one device slot for the three
adapters (--max-loras 1): slots evicted and uploaded again, sequences waiting for one, and
still identical on both backends. The strict device uploads slots whole here
(CS_STRICT_NO_STREAM=1), as the CPU backend has them at once: streaming slots change which
requests share a batch, and so the last bits (tests/test_cold_start.py holds that path).
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_strict_device.py"""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import transformers  # noqa: E402
from hfmodels import make_adapters, make_model, mixed_workload, run_batch  # noqa: E402

transformers.utils.logging.disable_progress_bar()


def run(model_dir, requests, loras, strict, extra=()):
    env = {"CS_TEST_DEVICE": "strict", "CS_STRICT_NO_STREAM": "1"} if strict else {}
    return run_batch(model_dir, requests, loras, ("--preload-adapters", *extra), env, f"strict={strict}")

rng = random.Random(3)
cases = 0
for kind, dtype, kv_heads in (("llama", "float32", 2), ("qwen2", "bfloat16", 4)):
    model_dir, ref = make_model(kind, dtype=dtype, kv_heads=kv_heads, seed=11)
    # a BF16 slot among F32 ones
    loras = make_adapters(model_dir, ref, (4, 8, 16), seed=40, dtypes=("float32", "bfloat16", "float32"))
    reqs = mixed_workload(rng, [n for n, _ in loras])
    cpu, cpu_stats = run(model_dir, reqs, loras, strict=False)
    dev, dev_stats = run(model_dir, reqs, loras, strict=True)
    if len(cpu) != len(reqs) or len(dev) != len(reqs):
        reflib.fail(f"{kind}: {len(cpu)} and {len(dev)} output lines for {len(reqs)} requests")
    for a, b in zip(cpu, dev):
        if a != b:
            reflib.fail(f"{kind} {dtype}: the strict device differs from the CPU backend\n  cpu:    {a[:400]}\n"
                        f"  strict: {b[:400]}")
    samples = sum(len(json.loads(x)["samples"]) if "samples" in json.loads(x) else 1 for x in cpu)
    be = dev_stats.get("backend", {})
    if be.get("name") != "strict" or not be.get("h2d_bytes") or not be.get("batch_uploads") or not be.get("d2d_bytes"):
        reflib.fail(f"{kind}: the strict device's stats do not show it worked: {be}")
    print(f"ok  {kind} {dtype}: {len(reqs)} requests ({samples} samples, 3 adapters + base) identical to the bit on the "
          f"strict device; it copied {be['h2d_bytes']} bytes in, {be['d2h_bytes']} out, {be['d2d_bytes']} device to "
          f"device (the n=3 fork), {be['batch_uploads']} batch uploads")
    cases += 1
    # one device slot for three adapters: sequences wait for the slot (never while holding one),
    # slots are evicted and uploaded again over the link; still the CPU backend's bits
    cpu1, cpu1_stats = run(model_dir, reqs, loras, strict=False, extra=("--max-loras", "1"))
    dev1, dev1_stats = run(model_dir, reqs, loras, strict=True, extra=("--max-loras", "1"))
    if cpu1 != dev1:
        reflib.fail(f"{kind}: with --max-loras 1 the strict device differs from the CPU backend")
    if len(dev1) != len(reqs) or not dev1_stats.get("lora_device_evictions") or not dev1_stats.get("lora_device_waits"):
        reflib.fail(f"{kind}: --max-loras 1 did not make slots wait and evict: {dev1_stats}")
    for a, b in zip(cpu, cpu1):  # greedy requests give the same tokens whatever the batch
        ja, jb = json.loads(a), json.loads(b)
        if ja.get("samples") and jb.get("samples") and reqs[ja["id"]]["temperature"] == 0:
            if [x["tokens"] for x in ja["samples"]] != [x["tokens"] for x in jb["samples"]]:
                reflib.fail(f"{kind}: request {ja['id']} gave other tokens with --max-loras 1")
    print(f"ok  {kind}: --max-loras 1: {dev1_stats['lora_device_uploads']} uploads, "
          f"{dev1_stats['lora_device_evictions']} slot evictions, {dev1_stats['lora_device_waits']} waits; identical "
          f"on both backends")
print(f"PASS: {cases} models")
