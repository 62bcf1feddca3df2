"""test_ref_engine.py: the serving engine (`caraserve batch`: continuous batching, chunked
prefill, paged KV cache, prefix cache, batched heterogeneous LoRA, adapter host cache) against
running each request alone and against transformers + peft themselves.

1. 32 concurrent requests over 8 adapters of ranks 8/16/32/64 plus base-only rows, mixed
   prompt lengths and max_tokens, greedy and seeded sampling: every request's tokens equal
   running it alone, its logprobs (sampled token + top 5) agree within 1e-4 with running it
   alone and with transformers + peft teacher-forced on the same tokens.
2. Seeds: n=8 samples with seed s equal 8 requests with seeds s..s+7 (and the seeded requests
   of 1. equal themselves alone inside the busy batch).
3. Prefix cache: the same prompt and adapter again reuses its blocks (cached tokens reported,
   same logprobs); another adapter or a new version of the adapter does not.
4. KV exhaustion: a tiny KV budget and many long requests: preemption + recompute, every
   request completes with the results it has alone (under ASan the run is also leak-checked).
5. Adapter churn: 50 adapters through a host cache of 5, requests over all of them, equal to
   transformers + peft; a corrupt adapter fails only its own requests.
6. Abort and bad requests: abort mid-generation ends only that request; bad lines get errors."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import VOCAB, make_adapter, make_model  # noqa: E402
from peft import PeftModel  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4


def run_batch(model_dir, requests, loras=(), extra=(), expect_ok=True):
    path = reflib.tmpdir("cs_batch_") + "/requests.jsonl"
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    cmd = [reflib.CARASERVE, "batch", "--model", model_dir, "--requests", path, "--threads", "2", "--stats", *extra]
    for name, d in loras:
        cmd += ["--lora", f"{name}={d}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        reflib.fail(f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}")
    out = [json.loads(line) for line in p.stdout.splitlines()]
    stats = None
    for line in p.stderr.splitlines():
        if line.startswith("{"):
            stats = json.loads(line)
    return out, stats


def lp_equal(name, a, b, tol=TOL):
    """two samples: same tokens, logprobs and top-5 alternatives within tol"""
    if a["tokens"] != b["tokens"]:
        reflib.fail(f"{name}: tokens differ\n  {a['tokens']}\n  {b['tokens']}")
    worst = 0.0
    if "logprobs" in a:
        worst = float(np.max(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"])), initial=0))
        for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
            ids_a, ids_b = [t[0] for t in ta], [t[0] for t in tb]
            va, vb = np.array([t[1] for t in ta]), np.array([t[1] for t in tb])
            if ids_a != ids_b:
                # alternatives may swap places only where their logprobs tie within tol
                if not np.allclose(np.sort(va), np.sort(vb), atol=tol):
                    reflib.fail(f"{name}: top alternatives differ {ta} vs {tb}")
            else:
                worst = max(worst, float(np.max(np.abs(va - vb), initial=0)))
    if not worst <= tol:
        reflib.fail(f"{name}: logprobs differ by {worst:.3g} > {tol}")
    return worst


def hf_check(name, ref, prompt, sample, tol=TOL, greedy=False):
    """teacher-forced transformers (+ peft) on prompt + generated tokens: the logprob of each
    generated token and the top-5 alternatives"""
    toks = sample["tokens"]
    full = list(prompt) + toks
    logits = reflib.hf_logits(ref, full[:-1])
    lp = reflib.log_softmax64(logits)
    worst = 0.0
    for k, t in enumerate(toks):
        row = lp[len(prompt) - 1 + k]
        worst = max(worst, abs(row[t] - sample["logprobs"][k]))
        for tid, tlp in sample["top_logprobs"][k]:
            worst = max(worst, abs(row[tid] - tlp))
        if greedy and t != int(row.argmax()):
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > 1e-4:
                reflib.fail(f"{name}: greedy token {k} is {t}, transformers says {int(row.argmax())}")
    if not worst <= tol:
        reflib.fail(f"{name}: |logprob - transformers| {worst:.3g} > {tol}")
    return worst


rng = np.random.default_rng(7)


def rand_prompt(n):
    return [int(t) for t in rng.integers(3, VOCAB, size=n)]


# ---- the model and 8 adapters of ranks 8, 16, 32, 64 ----
model_dir, base_ref = make_model("llama", "float32", heads=4, kv_heads=2, layers=2, seed=11)
targets = ["all-linear", ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]]
adapters, refs = [], {None: base_ref}
for i, r in enumerate([8, 16, 32, 64, 8, 16, 32, 64]):
    d, aref = make_adapter(model_dir, base_ref, r=r, alpha=2 * r if i % 2 else r, targets=targets[i % 4], seed=100 + i,
                           rslora=(i == 5))
    adapters.append((f"a{i}", d))
    refs[f"a{i}"] = aref

# ---- 1 + 2: 32 concurrent requests, and seeds ----
reqs = []
for i in range(32):
    ad = None if i % 9 == 8 else f"a{i % 9}"
    sampled = i % 3 == 2
    reqs.append(dict(id=i, prompt_ids=rand_prompt(int(rng.integers(1, 90))), adapter=ad,
                     max_tokens=int(rng.integers(2, 30)), ignore_eos=True, logprobs=5,
                     temperature=0.8 if sampled else 0.0, seed=1000 + i, top_p=0.95 if i % 6 == 2 else 1.0))
seed_prompt = rand_prompt(37)
reqs.append(dict(id="n8", prompt_ids=seed_prompt, adapter="a3", n=8, seed=4242, temperature=1.0, max_tokens=12,
                 ignore_eos=True, logprobs=0))
for k in range(8):
    reqs.append(dict(id=f"s{k}", prompt_ids=seed_prompt, adapter="a3", seed=4242 + k, temperature=1.0, max_tokens=12,
                     ignore_eos=True, logprobs=0))

batched, st = run_batch(model_dir, reqs, adapters, ["--max-num-batched-tokens", "96", "--max-num-seqs", "48"])
alone, _ = run_batch(model_dir, reqs, adapters, ["--sequential", "--no-prefix-caching"])
if st["steps"] >= sum(r.get("max_tokens") for r in reqs):
    reflib.fail(f"the batched run took {st['steps']} steps: requests were not batched")
print(f"batched run: {st['steps']} iterations for {len(reqs)} requests ({st['prefill_tokens']} prefill, "
      f"{st['decode_tokens']} decode tokens)")
worst_alone = worst_hf = 0.0
for req, b, a in zip(reqs, batched, alone):
    if "error" in b or "error" in a:
        reflib.fail(f"request {req['id']}: {b.get('error') or a.get('error')}")
    for sb, sa in zip(b["samples"], a["samples"]):
        if sb["finish_reason"] != "length" or len(sb["tokens"]) != req["max_tokens"]:
            reflib.fail(f"request {req['id']}: finish {sb['finish_reason']} after {len(sb['tokens'])} tokens")
        worst_alone = max(worst_alone, lp_equal(f"request {req['id']} batched vs alone", sb, sa))
    if isinstance(req["id"], int):
        worst_hf = max(worst_hf, hf_check(f"request {req['id']} ({req['adapter']})", refs[req["adapter"]],
                                          req["prompt_ids"], b["samples"][0], greedy=req["temperature"] == 0))
print(f"ok  32 requests over 8 adapters (r8-r64) + base: batched = alone (max |dlogprob| {worst_alone:.2e}), "
      f"= transformers+peft (max {worst_hf:.2e})")
by_id = {r["id"]: r for r in batched}
n8 = by_id["n8"]["samples"]
for k in range(8):
    if n8[k]["tokens"] != by_id[f"s{k}"]["samples"][0]["tokens"]:
        reflib.fail(f"n=8 sample {k} differs from the request with seed 4242+{k}")
if len({tuple(s["tokens"]) for s in n8}) < 2:
    reflib.fail("all 8 samples are identical: seeds are not per sample")
print("ok  n=8 with seed s == 8 requests with seeds s..s+7 (and differ from each other)")

# ---- 3: prefix cache ----
pp = rand_prompt(50)
a1v2 = make_adapter(model_dir, base_ref, r=16, alpha=32, targets="all-linear", seed=999)[0]
pre = [dict(id="first", prompt_ids=pp, adapter="a1", max_tokens=6, logprobs=5),
       dict(id="again", prompt_ids=pp, adapter="a1", max_tokens=6, logprobs=5),
       dict(id="other", prompt_ids=pp, adapter="a2", max_tokens=6, logprobs=5),
       dict(id="base", prompt_ids=pp, max_tokens=6, logprobs=5),
       dict(id="base2", prompt_ids=pp, max_tokens=6, logprobs=5),
       {"add_adapter": {"name": "a1", "dir": a1v2}},
       dict(id="newver", prompt_ids=pp, adapter="a1", max_tokens=6, logprobs=5)]
for r in pre:
    r.update(ignore_eos=True, temperature=0.0)
res = {r.get("id", "ctl"): r for r in run_batch(model_dir, pre, adapters, ["--sequential"])[0]}
want = {"first": 0, "again": 48, "other": 0, "base": 0, "base2": 48, "newver": 0}
for k, v in want.items():
    if res[k]["cached_tokens"] != v:
        reflib.fail(f"prefix cache: request '{k}' reports {res[k]['cached_tokens']} cached tokens, want {v}")
lp_equal("prefix-cached request vs first", res["again"]["samples"][0], res["first"]["samples"][0], 1e-5)
if res["newver"]["adapter_version"] != 2 or res["first"]["adapter_version"] != 1:
    reflib.fail("adapter versions not reported")
v2ref = PeftModel.from_pretrained(type(base_ref).from_pretrained(model_dir, torch_dtype=torch.float32), a1v2).eval().float()
hf_check("new adapter version", v2ref, pp, res["newver"]["samples"][0])
print("ok  prefix cache: 48 of 50 prompt tokens reused for the same adapter+version, 0 for another adapter, "
      "base vs adapter or a new version; cached results equal uncached")

# ---- 4: KV exhaustion ----
long_reqs = [dict(id=i, prompt_ids=rand_prompt(int(rng.integers(40, 90))), adapter=f"a{i % 8}" if i % 3 else None,
                  max_tokens=int(rng.integers(40, 70)), ignore_eos=True, logprobs=2,
                  temperature=0.7 if i % 2 else 0.0, seed=77 + i) for i in range(12)]
# 2 layers x kv_dim 32 x 2 (K,V) x 4 bytes = 512 bytes per token: 12 blocks = 192 tokens
tiny, st = run_batch(model_dir, long_reqs, adapters, ["--kv-cache-bytes", str(12 * 16 * 512), "--max-model-len", "192"])
roomy, _ = run_batch(model_dir, long_reqs, adapters, ["--sequential", "--no-prefix-caching"])
if st["preemptions"] == 0:
    reflib.fail("KV exhaustion: no preemption happened; the budget is not tight")
for req, a, b in zip(long_reqs, tiny, roomy):
    if "error" in a:
        reflib.fail(f"KV exhaustion: request {req['id']}: {a['error']}")
    lp_equal(f"KV exhaustion request {req['id']}", a["samples"][0], b["samples"][0])
print(f"ok  KV exhaustion: 12 requests of up to 160 tokens in a 192-token cache: {st['preemptions']} preemptions, "
      f"all complete and equal to running alone")

# ---- 5: adapter churn: 50 adapters through a cache of 5; one corrupt ----
churn = []
for i in range(50):
    d = reflib.tmpdir("cs_churn_")
    subprocess.run([reflib.MKMODEL, "adapter", "--model", model_dir, "--out", d, "--rank", str(4 << (i % 3)),
                    "--seed", str(500 + i), "--std", "0.1"], check=True, capture_output=True)
    churn.append((f"c{i}", d))
bad = reflib.tmpdir("cs_corrupt_")
subprocess.run([reflib.MKMODEL, "adapter", "--model", model_dir, "--out", bad, "--seed", "1"], check=True,
               capture_output=True)
st_path = os.path.join(bad, "adapter_model.safetensors")
with open(st_path, "r+b") as f:
    f.truncate(os.path.getsize(st_path) - 100)
churn.append(("corrupt", bad))
creqs = []
for i in range(60):
    name = "corrupt" if i % 15 == 7 else f"c{(i * 7) % 50}"
    creqs.append(dict(id=i, prompt_ids=rand_prompt(int(rng.integers(1, 30))), adapter=name, max_tokens=4,
                      ignore_eos=True, logprobs=3))
out, st = run_batch(model_dir, creqs, churn, ["--max-cpu-loras", "5", "--max-num-seqs", "16"])
checked = 0
for req, o in zip(creqs, out):
    if req["adapter"] == "corrupt":
        err = o["samples"][0].get("error", "") if "samples" in o else o.get("error", "")
        if o["samples"][0]["finish_reason"] != "error" or "corrupt" not in err:
            reflib.fail(f"corrupt adapter request {req['id']}: {o}")
        continue
    s = o["samples"][0]
    if s["finish_reason"] != "length":
        reflib.fail(f"churn request {req['id']} ({req['adapter']}): {s}")
    if checked < 12:  # transformers + peft for a sample of them (each needs its own PeftModel)
        d = dict(churn)[req["adapter"]]
        ref = PeftModel.from_pretrained(type(base_ref).from_pretrained(model_dir, torch_dtype=torch.float32), d)
        hf_check(f"churn request {req['id']}", ref.eval().float(), req["prompt_ids"], s)
        checked += 1
if st["lora_evictions"] < 40:
    reflib.fail(f"adapter churn: only {st['lora_evictions']} evictions: the cache bound is not working")
print(f"ok  adapter churn: 50 adapters through a 5-adapter cache ({st['lora_loads']} loads, {st['lora_evictions']} "
      f"evictions), {checked} checked against transformers+peft; the corrupt adapter failed only its 4 requests")

# ---- 6: abort and bad input ----
ab = [dict(id="long", prompt_ids=rand_prompt(10), max_tokens=200, ignore_eos=True, abort_after=5),
      dict(id="short", prompt_ids=rand_prompt(10), max_tokens=20, ignore_eos=True),
      dict(id="bad-token", prompt_ids=[VOCAB + 5]),
      dict(id="too-long", prompt_ids=rand_prompt(10), max_tokens=5000),
      dict(id="no-adapter", prompt_ids=[5], adapter="nope"),
      dict(id="bad-temp", prompt_ids=[5], temperature=-1)]
out = {o["id"]: o for o in run_batch(model_dir, ab, adapters)[0]}
s = out["long"]["samples"][0]
if s["finish_reason"] != "abort" or not 5 <= len(s["tokens"]) <= 6:
    reflib.fail(f"abort: {s['finish_reason']} after {len(s['tokens'])} tokens")
if out["short"]["samples"][0]["finish_reason"] != "length" or len(out["short"]["samples"][0]["tokens"]) != 20:
    reflib.fail("abort of one request disturbed another")
for k, frag in [("bad-token", "out of range"), ("too-long", "maximum context length"), ("no-adapter", "does not exist"),
                ("bad-temp", "temperature")]:
    if frag not in out[k].get("error", ""):
        reflib.fail(f"bad request {k}: {out[k]}")
print("ok  abort ends only its request within an iteration; bad requests get clear errors")

# ---- 7: text, stop strings, stop_token_ids, min_tokens with a real tokenizer ----
import lzma  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

tokdir = reflib.tmpdir("cs_tok_")
src = os.path.join(reflib.SRCDIR, "tests", "data", "tokenizers", "spm-32k")
with lzma.open(os.path.join(src, "tokenizer.json.xz")) as f, open(os.path.join(tokdir, "tokenizer.json"), "wb") as g:
    g.write(f.read())
for fn in os.listdir(src):
    if not fn.endswith(".xz"):
        with open(os.path.join(src, fn), "rb") as f, open(os.path.join(tokdir, fn), "wb") as g:
            g.write(f.read())
tmodel = reflib.tmpdir("cs_tmodel_")
subprocess.run([reflib.MKMODEL, "model", "--out", tmodel, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--intermediate", "96", "--tokenizer", tokdir, "--seed", "5", "--init-std", "0.2"], check=True,
               capture_output=True)
hf_tok = Tokenizer.from_file(os.path.join(tokdir, "tokenizer.json"))
base = dict(prompt="The quick brown fox", max_tokens=40, ignore_eos=True, temperature=0.0)
plain = run_batch(tmodel, [base])[0][0]["samples"][0]
want_text = hf_tok.decode(plain["tokens"], skip_special_tokens=True)
if plain["text"] != want_text:
    reflib.fail(f"streamed text {plain['text']!r} != tokenizers.decode {want_text!r}")
text = plain["text"]
stop = None
for i in range(len(text) // 3, len(text) - 3):  # a stop string that starts mid-token somewhere
    cand = text[i:i + 3]
    if cand.strip() and text.find(cand) == i:
        stop = cand
        break
if stop is None:
    reflib.fail(f"no usable stop string in {text!r}")
cut = text.find(stop)
runs = run_batch(tmodel, [dict(base, stop=[stop]), dict(base, stop=["zzzz-never", stop + "#~"]),
                          dict(base, stop_token_ids=[plain["tokens"][5]]),
                          dict(base, stop_token_ids=[plain["tokens"][5]], min_tokens=12)])[0]
s0, s1, s2, s3 = (r["samples"][0] for r in runs)
if s0["finish_reason"] != "stop" or s0["text"] != text[:cut]:
    reflib.fail(f"stop {stop!r}: {s0['finish_reason']} {s0['text']!r}, want {text[:cut]!r}")
if s0["tokens"] != plain["tokens"][:len(s0["tokens"])] or hf_tok.decode(s0["tokens"]).find(stop) < 0:
    reflib.fail("stop string: the tokens are not the prefix that completes the stop string")
if s1["finish_reason"] != "length" or s1["text"] != text:
    reflib.fail(f"non-matching stop strings changed the output: {s1}")
first = plain["tokens"].index(plain["tokens"][5])
if s2["finish_reason"] != "stop" or s2["tokens"] != plain["tokens"][:first + 1]:
    reflib.fail(f"stop_token_ids: {s2}")
if s3["finish_reason"] not in ("stop", "length") or len(s3["tokens"]) < 12 or plain["tokens"][5] in s3["tokens"][:12]:
    reflib.fail(f"min_tokens: {s3}")
print(f"ok  text equals tokenizers.decode; stop {stop!r} cuts at byte {cut} ({len(s0['tokens'])} tokens); "
      f"stop_token_ids and min_tokens hold")

# ---- 8: --lora-dtype bf16: an F32 adapter held in BF16 ----
# the reference: transformers + peft in float32 on the same adapter with every lora_A and
# lora_B rounded by torch to bfloat16 (nearest even) and back; the unrounded adapter's
# logprobs must lie measurably further away (the flag did something)
bdir, bref = make_adapter(model_dir, base_ref, r=16, alpha=32, targets="all-linear", seed=4242)
breqs = [{"prompt_ids": rand_prompt(n), "max_tokens": 8, "temperature": 0, "logprobs": 5, "adapter": "b"}
         for n in (5, 40, 97)]
bout, bst = run_batch(model_dir, breqs, loras=[("b", bdir)], extra=("--lora-dtype", "bf16"))
if bst["lora_loads"] != 1:
    reflib.fail(f"--lora-dtype bf16: {bst['lora_loads']} adapter loads")
far = max(hf_check("lora-dtype bf16 vs the unrounded adapter", bref, r["prompt_ids"], o["samples"][0], tol=1.0)
          for r, o in zip(breqs, bout))
with torch.no_grad():
    for name, prm in bref.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
near = max(hf_check("lora-dtype bf16 vs peft on the rounded adapter", bref, r["prompt_ids"], o["samples"][0])
           for r, o in zip(breqs, bout))
if not far > 10 * near:
    reflib.fail(f"--lora-dtype bf16: {near:.3g} from the rounded adapter, {far:.3g} from the unrounded one: "
                "the weights were not held in BF16")
bad = subprocess.run([reflib.CARASERVE, "batch", "--model", model_dir, "--lora-dtype", "fp8"], capture_output=True,
                     text=True, stdin=subprocess.DEVNULL)
if bad.returncode != 2 or "--lora-dtype wants auto or bf16, got 'fp8'" not in bad.stderr:
    reflib.fail(f"--lora-dtype fp8: exit {bad.returncode}, {bad.stderr[:200]!r}")
print(f"ok  --lora-dtype bf16: within {near:.2e} of transformers + peft on the adapter rounded to bfloat16 "
      f"({far:.2e} from the unrounded one); a bad value is refused")
print("PASS")
