#!/usr/bin/env python3
"""test_sched_batch.py: the scheduling policies through `caraserve batch`. The same workload
(adapters of ranks 8 and 64 and the base model mixed, prompts of 1-120 tokens, a request with
its own SLO, n=2 samples, a KV cache small enough to preempt) runs under --scheduler fcfs and
--scheduler slo: every request must finish whole under both (a policy changes the order and
the chunks, never what a request gets: its tokens count, its finish), the stats name the
policy, and the cost model is fitted on the run and written by --cost-model-out. Bad
--scheduler values and bad "slo" objects are refused with a message.
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_sched_batch.py"""
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

root = reflib.tmpdir("cs_sched_")
model = os.path.join(root, "model")
subprocess.run([reflib.MKMODEL, "model", "--out", model, "--arch", "llama", "--hidden", "64", "--layers", "2",
                "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--dtype", "bf16",
                "--seed", "3"], check=True, capture_output=True)
loras = []
for name, rank in (("r8", 8), ("r64", 64)):
    d = os.path.join(root, name)
    subprocess.run([reflib.MKMODEL, "adapter", "--model", model, "--out", d, "--rank", str(rank), "--alpha",
                    str(2 * rank), "--seed", str(rank), "--dtype", "bf16"], check=True, capture_output=True)
    loras += ["--lora", f"{name}={d}"]

rng = random.Random(5)
reqs = []
for i in range(40):
    r = {"id": i, "prompt_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))],
         "max_tokens": rng.randrange(1, 24), "ignore_eos": True, "temperature": 0}
    a = (None, "r8", "r64")[i % 3]
    if a:
        r["adapter"] = a
    if i == 7:
        r["n"] = 2
    if i == 11:
        r["slo"] = {"ttft_ms": 500, "tpot_ms": 40}
    reqs.append(r)
path = os.path.join(root, "requests.jsonl")
with open(path, "w") as f:
    for r in reqs:
        f.write(json.dumps(r) + "\n")


def run(*extra, requests=path, ok=True):
    cmd = [reflib.CARASERVE, "batch", "--model", model, *loras, "--requests", requests, "--threads", "2", "--stats",
           "--kv-cache-bytes", "96K", "--max-num-batched-tokens", "64", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if ok and p.returncode != 0:
        reflib.fail(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return p


for policy in ("fcfs", "slo"):
    out = os.path.join(root, f"cost-{policy}.json")
    p = run("--scheduler", policy, "--cost-model-out", out)
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    stats = json.loads([x for x in p.stderr.splitlines() if x.startswith("{")][-1])
    if len(lines) != len(reqs):
        reflib.fail(f"{policy}: {len(lines)} results for {len(reqs)} requests")
    for res in lines:
        want = reqs[res["id"]]
        for smp in res["samples"]:
            if smp["finish_reason"] != "length" or len(smp["tokens"]) != want["max_tokens"]:
                reflib.fail(f"{policy}: request {res['id']}: {smp['finish_reason']} after {len(smp['tokens'])} "
                            f"tokens, want length after {want['max_tokens']}")
        if len(res["samples"]) != want.get("n", 1):
            reflib.fail(f"{policy}: request {res['id']}: {len(res['samples'])} samples")
    cm = stats.get("cost_model")
    if stats.get("scheduler") != policy or not cm or cm["n_fit"] < 6:
        reflib.fail(f"{policy}: stats {stats.get('scheduler')} {cm}")
    saved = json.load(open(out))
    if set(saved["terms"]) != {"fixed", "prefill_tokens", "decode_rows", "adapter_rank_sum", "rows_x_max_rank",
                               "row_rank_sum"} or any(v < 0 for v in saved["terms"].values()):
        reflib.fail(f"{policy}: the saved cost model {saved}")
    print(f"ok  --scheduler {policy}: {len(reqs)} requests whole ({stats['steps']} steps, {stats['preemptions']} "
          f"preemptions); cost model R² {cm['r2']:.3f} over {cm['n_fit']} steps")

p = run("--scheduler", "lifo", ok=False)
if p.returncode == 0 or "the policies are fcfs and slo" not in p.stderr:
    reflib.fail(f"--scheduler lifo: exit {p.returncode}: {p.stderr[-500:]}")
bad = os.path.join(root, "bad.jsonl")
with open(bad, "w") as f:
    f.write(json.dumps({"prompt_ids": [5, 6], "max_tokens": 2, "slo": {"tpot_ms": 0}}) + "\n")
p = run(requests=bad, ok=False)
if "slo.tpot_ms must be a number of milliseconds > 0" not in p.stdout + p.stderr:
    reflib.fail(f"a bad slo: {p.stdout[-300:]} {p.stderr[-300:]}")
print("ok  an unknown --scheduler and a bad slo are refused with a message")
print("PASS")
