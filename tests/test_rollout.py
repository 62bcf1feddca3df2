"""test_rollout.py: POST /v1/rollout (rollout_api/) end to end, against transformers + peft.

1. Determinism: with --batch-invariant the same seeded rollout gives identical ids and
   logprobs, to the bit, cold, with its prompts in the prefix cache, while another rollout
   shares the batches, and group by group alone. Without the flag the same prefix-cache
   state still gives the same bits (a GEMM's rounding depends on its row count, so cold and
   warm runs may differ in the last bits there); every run is held to transformers.
2. The training/inference mismatch: every sampled token's logprob equals transformers + peft
   (raw mode: log_softmax of the logits; processed mode at temperature T: log_softmax of
   logits / T) within 1e-4 for float32 weights, base model and adapter, greedy and sampled.
3. Groups: n samples of a group are seeded seed + i (a group of n equals n groups of one with
   those seeds) and share the prompt (shared_prompt_tokens); NDJSON streaming gives one line
   per group, then the summary.
4. Partial rollouts: with target_groups = half the groups the rest come back as "abort" with
   their partial tokens, and continue_from those tokens reproduces the uninterrupted greedy
   run token for token; /v1/rollout/abort ends a running batch, partial results included.
5. SGLang's /generate and /abort_request give the same tokens in SGLang's shape.
6. /v1/pause keep/wait/abort and /v1/resume."""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from serverlib import Server, make_tok_model, wait_for  # noqa: E402

torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4

model_dir, ref_base, _ = make_tok_model("spm-32k", seed=5)
a_dir, ref_a = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=31)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules", f"pol={a_dir}", "--threads", "2",
              "--kv-cache-bytes", "64M"])


def rollout(body):
    st, r, _ = srv.request("POST", "/v1/rollout", body)
    if st != 200:
        reflib.fail(f"/v1/rollout: {st} {r}")
    return r


def lsm(ref, ids, temp=1.0):
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].double().numpy()
    return reflib.log_softmax64(logits / temp)


rng = np.random.default_rng(0)
prompts = [[1] + [int(x) for x in rng.integers(100, 32000, size=k)] for k in (5, 17, 33, 9)]

# ---- 1 + 2 ----
worst = 0.0
for adapter, ref in (("base", ref_base), ("pol", ref_a)):
    for temp, mode in ((0.0, "raw"), (0.8, "processed"), (1.0, "raw")):
        body = {"adapter": adapter, "sampling": {"max_tokens": 12, "temperature": temp, "ignore_eos": True,
                                                 "logprobs": {"mode": mode}},
                "groups": [{"group_id": f"g{i}", "input_ids": p, "n": 2, "seed": 100 + i} for i, p in enumerate(prompts)]}
        # The first run prefills whole prompts; the next ones find prompt blocks in the prefix
        # cache, so their batches hold other row counts. The kernels are not batch-invariant
        # (a GEMM's rounding depends on its row count), so run 1 and run 2 may differ in the
        # last bits (and a greedy near-tie could flip); both are held to transformers below.
        # Runs 2 and 3 see the same cache and must be identical to the bit. Batch invariance
        # is --batch-invariant's (tests/test_batch_invariant.c).
        r1, r2, r3 = rollout(body), rollout(body), rollout(body)
        dump = [json.dumps([[(s["output_ids"], s["logprobs"]) for s in g["samples"]] for g in r["groups"]])
                for r in (r1, r2, r3)]
        if dump[1] != dump[2]:
            reflib.fail(f"{adapter} T={temp}: the same rollout with the same cache state differs")
        for g in r1["groups"] + r2["groups"]:
            p = prompts[int(g["group_id"][1:])]
            for s in g["samples"]:
                if s["adapter_version"] != (1 if adapter == "pol" else 0) or len(s["output_ids"]) != 12:
                    reflib.fail(f"sample {s}")
                ls = lsm(ref, p + s["output_ids"], temp if mode == "processed" else 1.0)
                for k, (t, lp) in enumerate(zip(s["output_ids"], s["logprobs"])):
                    row = ls[len(p) + k - 1]
                    worst = max(worst, abs(lp - row[t]))
                    if temp == 0 and row.max() - row[t] > TOL:
                        reflib.fail(f"greedy token {t} is not the argmax")
if worst > TOL:
    reflib.fail(f"rollout logprobs differ from transformers+peft by {worst:.2e}")
print(f"ok  rollouts are deterministic; sampled-token logprobs equal transformers+peft (raw and processed, "
      f"base and adapter): max |diff| {worst:.2e}")

# ---- the logprob contract: processed logprobs under top-k/top-p are renormalised over the kept
# tokens; kept_logmass is the log of the mass kept, so processed + kept_logmass is the trainer's
# log_softmax(logits / T) (vLLM's processed logprobs differ from it by exactly that) ----
def kept_set(q, top_k, top_p):
    """vLLM's top-k (ties with the k-th kept), then top-p over the renormalised survivors"""
    order = sorted(range(len(q)), key=lambda i: (-q[i], i))
    kth = q[order[top_k - 1]]
    cand = [i for i in order if q[i] >= kth]
    z = np.logaddexp.reduce(q[cand])
    keep, mass = [], 0.0
    for i in cand:
        if mass >= top_p:
            break
        keep.append(i)
        mass += float(np.exp(q[i] - z))
    return keep


body = {"sampling": {"max_tokens": 10, "temperature": 0.7, "top_k": 40, "top_p": 0.8, "ignore_eos": True,
                     "logprobs": {"mode": "processed", "kept_mass": True}},
        "groups": [{"input_ids": p, "n": 2, "seed": 7 + i} for i, p in enumerate(prompts[:2])]}
worst_id, worst_mass, cut = 0.0, 0.0, 0
for gi, g in enumerate(rollout(body)["groups"]):
    p = prompts[gi]
    for s in g["samples"]:
        q_all = lsm(ref_base, p + s["output_ids"], 0.7)
        for k, (t, lp, km) in enumerate(zip(s["output_ids"], s["logprobs"], s["kept_logmass"])):
            q = q_all[len(p) + k - 1]
            worst_id = max(worst_id, abs(lp + km - q[t]))
            worst_mass = max(worst_mass, abs(km - np.logaddexp.reduce(q[kept_set(q, 40, 0.8)])))
            cut += km < -1e-3
if worst_id > TOL or worst_mass > TOL or cut == 0:
    reflib.fail(f"kept_logmass: |processed + kept - trainer| {worst_id:.2e}, |kept - transformers' kept mass| "
                f"{worst_mass:.2e}, {cut} tokens cut")
for bad in ({"mode": "raw", "kept_mass": True}, {"mode": "processed", "kept_mass": 1}):
    st, r, _ = srv.request("POST", "/v1/rollout", {"sampling": {"logprobs": bad}, "groups": [{"input_ids": prompts[0]}]})
    if st != 400 or "kept_mass" not in r["error"]["message"]:
        reflib.fail(f"logprobs {bad}: {st} {r}")
print(f"ok  processed logprobs under top-k 40 / top-p 0.8: processed + kept_logmass = transformers' log_softmax(logits/T) "
      f"within {worst_id:.1e}; kept_logmass = the kept set's mass within {worst_mass:.1e} ({cut} tokens cut)")

# ---- 1 with --batch-invariant: cold, warm, beside other work and alone give the same bits ----
inv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules", f"pol={a_dir}", "--threads", "2",
              "--kv-cache-bytes", "64M", "--batch-invariant"])


def inv_rollout(body):
    st, r, _ = inv.request("POST", "/v1/rollout", body)
    if st != 200:
        reflib.fail(f"/v1/rollout (--batch-invariant): {st} {r}")
    return r


def samples_of(r):
    return {(g["group_id"], i): (s["output_ids"], s["logprobs"]) for g in r["groups"] for i, s in enumerate(g["samples"])}


worst_inv = 0.0
for adapter, ref in (("base", ref_base), ("pol", ref_a)):
    for temp in (0.0, 1.0):
        body = {"adapter": adapter, "sampling": {"max_tokens": 12, "temperature": temp, "ignore_eos": True},
                "groups": [{"group_id": f"g{i}", "input_ids": p, "n": 2, "seed": 100 + i} for i, p in enumerate(prompts)]}
        cold = samples_of(inv_rollout(body))
        warm = samples_of(inv_rollout(body))
        # beside a rollout of other prompts and lengths (other batch rows, other prefill chunks)
        noise = {"adapter": "pol" if adapter == "base" else "base", "sampling": {"max_tokens": 30, "ignore_eos": True},
                 "groups": [{"input_ids": [1] + [int(x) for x in rng.integers(100, 32000, size=k)], "n": 3}
                            for k in (60, 7, 25)]}
        out = []
        th = threading.Thread(target=lambda: out.append(inv_rollout(noise)))
        th.start()
        busy = samples_of(inv_rollout(body))
        th.join()
        alone = {}
        for gi in range(len(prompts)):
            alone.update(samples_of(inv_rollout(dict(body, groups=[body["groups"][gi]]))))
        for name, run in (("warm (prefix cached)", warm), ("beside another rollout", busy), ("group alone", alone)):
            if run != cold:
                diff = [k for k in cold if run.get(k) != cold[k]]
                reflib.fail(f"--batch-invariant {adapter} T={temp}: the {name} run differs from the cold run in {diff}")
        for (gid, _), (ids, lps) in cold.items():
            p = prompts[int(gid[1:])]
            ls = lsm(ref, p + ids)
            for k, (t, lp) in enumerate(zip(ids, lps)):
                worst_inv = max(worst_inv, abs(lp - ls[len(p) + k - 1][t]))
if worst_inv > TOL:
    reflib.fail(f"--batch-invariant logprobs differ from transformers+peft by {worst_inv:.2e}")
# continue_from of a sampled run with penalties: the resumed tokens count as output for the
# penalties and the sampler's random stream skips their draws, so the continuation is the
# uninterrupted sample, ids and logprobs to the bit
pen = {"max_tokens": 30, "temperature": 1.0, "ignore_eos": True, "presence_penalty": 0.8, "frequency_penalty": 0.5,
       "repetition_penalty": 1.3}
for adapter in ("base", "pol"):
    whole = inv_rollout({"adapter": adapter, "sampling": pen, "groups": [{"input_ids": prompts[2], "seed": 77}]})
    ws = whole["groups"][0]["samples"][0]
    for cut in (1, 12, 29):
        part = inv_rollout({"adapter": adapter, "sampling": pen, "groups": [
            {"input_ids": prompts[2], "seed": 77, "continue_from": {"output_ids": ws["output_ids"][:cut]}}]})
        ps = part["groups"][0]["samples"][0]
        if ps["output_ids"] != ws["output_ids"][cut:] or ps["logprobs"] != ws["logprobs"][cut:] or \
                ps["resumed_len"] != cut:
            reflib.fail(f"{adapter}: continue_from {cut} tokens of a sampled run with penalties differs from the "
                        f"uninterrupted run: {ps['output_ids']} vs {ws['output_ids'][cut:]}")
if inv.stop() != 0:
    reflib.fail("--batch-invariant server exit status")
print(f"ok  --batch-invariant: cold, warm, beside another rollout and group-alone runs give identical ids and "
      f"logprobs to the bit (base and adapter, greedy and T=1); max |diff| to transformers+peft {worst_inv:.2e}; "
      f"continue_from a sampled run with penalties (after 1, 12, 29 tokens) reproduces it to the bit")

# ---- 3 ----
samp = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
one = rollout({"sampling": samp, "groups": [{"input_ids": prompts[1], "n": 4, "seed": 7}]})["groups"][0]
sep = rollout({"sampling": samp, "groups": [{"input_ids": prompts[1], "n": 1, "seed": 7 + i} for i in range(4)]})["groups"]
if [s["output_ids"] for s in one["samples"]] != [g["samples"][0]["output_ids"] for g in sep]:
    reflib.fail("a group of n=4 with seed 7 differs from 4 groups with seeds 7..10")
if one["shared_prompt_tokens"] != 3 * len(prompts[1]) or [s["seed"] for s in one["samples"]] != [7, 8, 9, 10]:
    reflib.fail(f"group sharing: {one['shared_prompt_tokens']} {[s['seed'] for s in one['samples']]}")
# a group of n=16 computes its prompt once: the engine's prefill counter grows by the prompt only
fresh = [1] + [int(x) for x in rng.integers(100, 32000, size=40)]
pf0 = srv.metrics()[1]["caraserve_prefill_tokens_total"]
g16 = rollout({"sampling": {"max_tokens": 4, "ignore_eos": True}, "groups": [{"input_ids": fresh, "n": 16}]})["groups"][0]
pf1 = srv.metrics()[1]["caraserve_prefill_tokens_total"]
if pf1 - pf0 != len(fresh) or g16["shared_prompt_tokens"] != 15 * len(fresh) or len(g16["samples"]) != 16:
    reflib.fail(f"n=16: {pf1 - pf0} prompt tokens computed for a {len(fresh)}-token prompt; shared {g16['shared_prompt_tokens']}")
st, txt, hdr = srv.request("POST", "/v1/rollout", {"stream": True, "batch_id": "s1", "sampling": samp,
                                                   "groups": [{"input_ids": p, "n": 2} for p in prompts]})
lines = [json.loads(x) for x in txt.splitlines()] if st == 200 and isinstance(txt, str) else None
if not lines or len(lines) != 5 or "summary" not in lines[-1] or lines[-1]["summary"]["completed_groups"] != 4 or \
        hdr.get("Content-Type") != "application/x-ndjson":
    reflib.fail(f"NDJSON stream: {st} {txt!r:.500}")
print("ok  a group of n equals n groups seeded seed+i; n=16 computes its 41-token prompt once; NDJSON: a line per "
      "group + summary")

# ---- 4 ----
greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
long_prompts = prompts + [[1] + [int(x) for x in rng.integers(100, 32000, size=k)] for k in (11, 23, 7, 3)]
full = rollout({"adapter": "pol", "sampling": greedy,
                "groups": [{"group_id": str(i), "input_ids": p} for i, p in enumerate(long_prompts)]})
want = {g["group_id"]: g["samples"][0]["output_ids"] for g in full["groups"]}
# stagger the groups: group i resumes from the first 4i tokens of its full run (max_tokens counts
# the whole sample), so the later groups finish first and the target cuts the first ones short
cont = {str(i): want[str(i)][:4 * i] for i in range(len(long_prompts))}
body = {"adapter": "pol", "sampling": greedy, "completion": {"target_groups": 4},
        "groups": [{"group_id": str(i), "input_ids": p, "continue_from": {"output_ids": cont[str(i)]}}
                   for i, p in enumerate(long_prompts)]}
part = rollout(body)
summ = part["summary"]
aborted = [g for g in part["groups"] if g["samples"][0]["finish_reason"] == "abort"]
if summ["completed_groups"] != 4 or summ["aborted_groups"] != 4 or not summ["target_reached"] or \
        len(part["groups"]) != 8 or len(aborted) != 4:
    reflib.fail(f"target_groups: {summ}")
for g in part["groups"]:
    s0 = g["samples"][0]
    got = cont[g["group_id"]] + s0["output_ids"]
    if s0["resumed_len"] != len(cont[g["group_id"]]) or got != want[g["group_id"]][:len(got)]:
        reflib.fail(f"group {g['group_id']}: resumed + new tokens are not a prefix of the full run")
    if s0["finish_reason"] == "length" and len(got) != 40:
        reflib.fail(f"group {g['group_id']}: max_tokens must count the resumed tokens")
resumed = rollout({"adapter": "pol", "sampling": greedy,
                   "groups": [{"group_id": g["group_id"], "input_ids": long_prompts[int(g["group_id"])],
                               "continue_from": {"output_ids": cont[g["group_id"]] + g["samples"][0]["output_ids"]}}
                              for g in aborted]})
for g in resumed["groups"]:
    s0 = g["samples"][0]
    prev = cont[g["group_id"]] + next(a for a in aborted if a["group_id"] == g["group_id"])["samples"][0]["output_ids"]
    if s0["resumed_len"] != len(prev) or prev + s0["output_ids"] != want[g["group_id"]]:
        reflib.fail(f"continue_from group {g['group_id']}: {prev} + {s0['output_ids']} != {want[g['group_id']]}")
print(f"ok  target_groups 4 of 8: 4 completed, 4 aborted with partial tokens "
      f"({[len(g['samples'][0]['output_ids']) for g in aborted]}); continue_from reproduces the uninterrupted "
      f"greedy runs token for token")

# held running with tokens generated (engine paused), then aborted: partial by construction
th, res = srv.hold_call(lambda: rollout({"batch_id": "long", "sampling": {"max_tokens": 1500, "ignore_eos": True},
                                         "groups": [{"input_ids": prompts[0], "n": 2}]}), "the long rollout")
st, ab, _ = srv.request("POST", "/v1/rollout/abort", {"batch_id": "long"})
th.join()
srv.resume()
s0 = res[0]["groups"][0]["samples"]
if st != 200 or ab["aborted"] != 1 or [s["finish_reason"] for s in s0] != ["abort", "abort"] or \
        not all(0 < len(s["output_ids"]) < 1500 and len(s["logprobs"]) == len(s["output_ids"]) for s in s0):
    reflib.fail(f"/v1/rollout/abort: {st} {ab} {[(s['finish_reason'], len(s['output_ids'])) for s in s0]}")
print(f"ok  /v1/rollout/abort: the batch returned with partial samples ({[len(s['output_ids']) for s in s0]} tokens)")
# SGLang's /generate and /abort_request, as slime and AReaL call them
st, gen, _ = srv.request("POST", "/generate", {"input_ids": long_prompts[1], "lora_path": "pol", "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True}, "rid": "x1"})
if st != 200 or gen["output_ids"] != want["1"] or gen["meta_info"]["finish_reason"]["type"] != "length" or \
        gen["meta_info"]["weight_version"] != "default" or gen["meta_info"]["adapter_version"] != 1 or [t for _, t, _ in gen["meta_info"]["output_token_logprobs"]] != want["1"] \
        or gen["meta_info"]["id"] != "x1" or gen["meta_info"]["completion_tokens"] != 40:
    reflib.fail(f"/generate: {st} {gen}")
st, genb, _ = srv.request("POST", "/generate", {"input_ids": [long_prompts[0], long_prompts[2]], "lora_path": "pol",
                                                "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                    "ignore_eos": True}})
if st != 200 or [g["output_ids"] for g in genb] != [want["0"], want["2"]]:
    reflib.fail(f"/generate batch: {st} {genb}")
th, res = srv.hold_call(lambda: srv.request("POST", "/generate", {
    "input_ids": prompts[0], "rid": "slow", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}),
    "the slow /generate")
st, ab, _ = srv.request("POST", "/abort_request", {"rid": "slow"})
th.join()
srv.resume()
if st != 200 or res[0][1]["meta_info"]["finish_reason"]["type"] != "abort" or len(res[0][1]["output_ids"]) >= 1500:
    reflib.fail(f"/abort_request: {st} {ab} {res[0][1]['meta_info']}")
# slime's sampling_seed and SGLang's top_logprobs_num, return_text_in_logprobs, skip_special_tokens
hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
st, gs, _ = srv.request("POST", "/generate", {"input_ids": prompts[2], "return_logprob": True, "top_logprobs_num": 3,
                                              "return_text_in_logprobs": True,
                                              "sampling_params": {"max_new_tokens": 10, "temperature": 1.0,
                                                                  "sampling_seed": 5, "ignore_eos": True,
                                                                  "skip_special_tokens": False}})
ro = rollout({"sampling": {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True, "logprobs": {"top_k": 3}},
              "groups": [{"input_ids": prompts[2], "seed": 5}]})["groups"][0]["samples"][0]
m = gs["meta_info"] if st == 200 else {}
if st != 200 or gs["output_ids"] != ro["output_ids"] or \
        [lp for lp, _, _ in m["output_token_logprobs"]] != ro["logprobs"] or \
        [[(t, lp) for lp, t, _ in row] for row in m["output_top_logprobs"]] != [[tuple(x) for x in row] for row in ro["top_logprobs"]] or \
        [txt for _, t, txt in m["output_token_logprobs"]] != [hf_tok.decode([t]) for t in ro["output_ids"]] or \
        any(txt != hf_tok.decode([t]) for row in m["output_top_logprobs"] for _, t, txt in row) or \
        gs["text"] != hf_tok.decode(ro["output_ids"], skip_special_tokens=False):
    reflib.fail(f"/generate with sampling_seed, top_logprobs_num, return_text_in_logprobs: {st} {gs} vs {ro}")
# SGLang trims the stop string from the text (no_stop_trim keeps it) and says what matched
base_gen = {"input_ids": prompts[1], "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
st, g0, _ = srv.request("POST", "/generate", base_gen)
full = g0["text"]
k = next(i for i in range(4, len(full) - 3) if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i)
stop = full[k:k + 3]
for nst in (False, True):
    st, gt, _ = srv.request("POST", "/generate", {"input_ids": prompts[1], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": nst}})
    want_text = full[:k + 3] if nst else full[:k]
    if st != 200 or gt["meta_info"]["finish_reason"] != {"type": "stop", "matched": stop} or \
            not gt["text"].startswith(want_text) or (not nst and gt["text"] != want_text) or \
            gt["output_ids"] != g0["output_ids"][:len(gt["output_ids"])]:
        reflib.fail(f"/generate stop {stop!r} no_stop_trim {nst}: {st} {gt} (full text {full!r})")
if g0["meta_info"]["finish_reason"] != {"type": "length", "length": 24}:
    reflib.fail(f"/generate finish_reason at the length: {g0['meta_info']['finish_reason']}")
for bad, field in (({"top_logprobs_num": -1}, "top_logprobs_num"), ({"return_text_in_logprobs": 1}, "return_text_in_logprobs"),
                   ({"sampling_params": {"sampling_seed": "x"}}, "sampling_params.sampling_seed"),
                   ({"sampling_params": {"no_stop_trim": 1}}, "sampling_params.no_stop_trim")):
    st, r, _ = srv.request("POST", "/generate", dict({"input_ids": prompts[0]}, **bad))
    if st != 400 or r["error"]["param"] != field:
        reflib.fail(f"/generate {bad}: {st} {r}")
print("ok  SGLang /generate (ids, batch, logprobs, weight_version, sampling_seed, top_logprobs_num, return_text_in_logprobs, stop trimming and no_stop_trim) equals the rollout; /abort_request by rid")
# pause / resume (a trainer updating weights)
def bg(body):
    out = []
    t = threading.Thread(target=lambda: out.append(rollout(body)))
    t.start()
    return t, out


long_body = {"adapter": "pol", "sampling": {"max_tokens": 600, "temperature": 0, "ignore_eos": True},
             "groups": [{"input_ids": long_prompts[3]}]}
ref_long = rollout(long_body)["groups"][0]["samples"][0]["output_ids"]
held = []


def start_held():
    held[:] = [bg(long_body)]
    return [held[0][0]]


# keep: held running with tokens generated; /v1/pause answers once the iteration under way ended
srv.hold_running(start_held, "the rollout to pause")
t1, o1 = held[0]
g0 = srv.gen_tokens()
t2, o2 = bg(long_body)  # accepted while paused: waits
wait_for(lambda: srv.metrics()[1]["caraserve_num_requests_waiting"] >= 1, 120, "the rollout sent during the pause to queue")
time.sleep(0.3)  # room for a wrong token to show up (a correct server cannot produce one)
if srv.gen_tokens() != g0 or o1 or o2:
    reflib.fail(f"pause keep: tokens {g0} -> {srv.gen_tokens()} while paused")
srv.resume()
t1.join()
t2.join()
if o1[0]["groups"][0]["samples"][0]["output_ids"] != ref_long or o2[0]["groups"][0]["samples"][0]["output_ids"] != ref_long:
    reflib.fail("pause keep + resume: the paused rollout and the one sent during the pause must equal the unpaused run")
# wait: from a held rollout, pause wait lets it run to its end, then answers
srv.hold_running(start_held, "the rollout to pause")
t1, o1 = held[0]
st, pz, _ = srv.request("POST", "/v1/pause", {"mode": "wait"})
t1.join()  # still paused: the in-flight rollout ran to its end
srv.resume()
if st != 200 or o1[0]["groups"][0]["samples"][0]["output_ids"] != ref_long or \
        o1[0]["groups"][0]["samples"][0]["finish_reason"] != "length":
    reflib.fail(f"pause wait: {st} {pz}, {o1}")
# abort: from a held rollout, pause abort ends it now with its partial tokens
srv.hold_running(start_held, "the rollout to pause")
t1, o1 = held[0]
st, pz, _ = srv.request("POST", "/v1/pause", {"mode": "abort"})
t1.join()
s0 = o1[0]["groups"][0]["samples"][0]
srv.resume()
if st != 200 or s0["finish_reason"] != "abort" or not 0 < len(s0["output_ids"]) < 600 or \
        s0["output_ids"] != ref_long[:len(s0["output_ids"])]:
    reflib.fail(f"pause abort: {st} {pz} {s0['finish_reason']} {len(s0['output_ids'])}")
print("ok  /v1/pause keep (no token while paused, requests sent meanwhile wait; resume gives the unpaused tokens), "
      "wait (answers once in-flight finished), abort (partial results); /v1/resume")
# the same under vLLM's names (POST /pause?mode=..., no body; /resume; GET /is_paused), as TRL
# and vLLM's RLHF examples call them, and SGLang's (/pause_generation, /continue_generation
# with {} or {"mode": ...}), as AReaL and slime call them
def paused():
    st, r, _ = srv.request("GET", "/is_paused")
    if st != 200 or set(r) != {"is_paused"}:
        reflib.fail(f"/is_paused: {st} {r}")
    return r["is_paused"]


if paused():
    reflib.fail("/is_paused says paused before any pause")
st, r, _ = srv.request("POST", "/pause?mode=keep")
if st != 200 or r != {"status": "paused"} or not paused():
    reflib.fail(f"vLLM /pause?mode=keep: {st} {r}")
st, r, _ = srv.request("POST", "/resume")
if st != 200 or r != {"status": "resumed"} or paused():
    reflib.fail(f"vLLM /resume: {st} {r}")
for path, body, frag in (("/pause?mode=nope", None, "mode"), ("/pause?clear_cache=maybe", None, "clear_cache"),
                         ("/pause_generation", {"mode": "nope"}, "mode")):
    st, r, _ = srv.request("POST", path, body)
    if st != 400 or frag not in json.dumps(r) or paused():
        reflib.fail(f"{path} {body}: want a 400 naming {frag}, unpaused: {st} {r}")
st, r, _ = srv.request("GET", "/pause")
if st != 405:
    reflib.fail(f"GET /pause: {st} {r}")


def vllm_pause_keep():
    st, r, _ = srv.request("POST", "/pause?mode=keep&clear_cache=true")
    if st != 200 or r != {"status": "paused"}:
        reflib.fail(f"/pause?mode=keep: {st} {r}")


def vllm_hold():
    """as hold_running, paused through vLLM's /pause?mode=keep; the held rollout's thread and output"""
    srv.hold_running(start_held, "the rollout to pause", pause=vllm_pause_keep,
                     resume=lambda: srv.request("POST", "/resume"))
    return held[0]


# vLLM keep: held, then /resume gives the unpaused tokens
t1, o1 = vllm_hold()
g0 = srv.gen_tokens()
time.sleep(0.2)  # room for a wrong token to show up
if srv.gen_tokens() != g0 or o1 or not paused():
    reflib.fail("vLLM /pause?mode=keep: tokens while paused")
srv.request("POST", "/resume")
t1.join()
if o1[0]["groups"][0]["samples"][0]["output_ids"] != ref_long:
    reflib.fail("vLLM /pause?mode=keep + /resume: the paused rollout must equal the unpaused run")
# vLLM's default mode is abort: the held rollout ends now with its partial tokens
t1, o1 = vllm_hold()
st, r, _ = srv.request("POST", "/pause")
t1.join()
s0 = o1[0]["groups"][0]["samples"][0]
srv.request("POST", "/resume")
if st != 200 or r != {"status": "paused"} or s0["finish_reason"] != "abort" or \
        s0["output_ids"] != ref_long[:len(s0["output_ids"])]:
    reflib.fail(f"vLLM /pause (abort): {st} {r} {s0['finish_reason']}")
# SGLang in_place (AReaL's body {} is abort, SGLang's default) on a held rollout, then continue
t1, o1 = vllm_hold()
st, r, _ = srv.request("POST", "/pause_generation", {"mode": "in_place"})
ok_p = st == 200 and r == {"message": "Generation paused successfully.", "status": "ok"} and paused()
st, r, _ = srv.request("POST", "/continue_generation", {})
t1.join()
if not ok_p or st != 200 or r != {"message": "Generation continued successfully.", "status": "ok"} or paused() or \
        o1[0]["groups"][0]["samples"][0]["output_ids"] != ref_long:
    reflib.fail(f"SGLang pause in_place / continue: {st} {r}")
t1, o1 = vllm_hold()
st, r, _ = srv.request("POST", "/pause_generation", {})  # AReaL's body: abort
t1.join()
s0 = o1[0]["groups"][0]["samples"][0]
st2, r2, _ = srv.request("POST", "/continue_generation")  # no body at all
if st != 200 or s0["finish_reason"] != "abort" or st2 != 200 or paused():
    reflib.fail(f"SGLang /pause_generation {{}} (abort): {st} {r} {s0['finish_reason']} / {st2} {r2}")
print("ok  vLLM's /pause?mode=keep|abort (default abort), /resume, /is_paused and SGLang's /pause_generation "
      "(in_place, {} = abort) and /continue_generation, with their bodies and answers")
# the prefix cache emptied: SGLang's /flush_cache (GET or POST), vLLM's /reset_prefix_cache and
# /pause with clear_cache (the default) in abort or wait mode; never in keep mode
flush_prompt = [1] + [int(x) for x in rng.integers(100, 32000, size=50)]  # three full blocks


def cached():
    st, g, _ = srv.request("POST", "/generate", {"input_ids": flush_prompt, "lora_path": "pol", "return_logprob": True,
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    if st != 200:
        reflib.fail(f"/generate: {st} {g}")
    return g["meta_info"]["cached_tokens"], (g["output_ids"], [x[0] for x in g["meta_info"]["output_token_logprobs"]])


def same(a, b):
    """the same tokens; logprobs equal within float32 reassociation (a cached prefix changes the
    prefill's shapes; --batch-invariant, tested above, makes them bitwise equal)"""
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-4


c0, ref_out = cached()
for what, call in (("GET /flush_cache", lambda: srv.request("GET", "/flush_cache")),
                   ("POST /flush_cache", lambda: srv.request("POST", "/flush_cache")),
                   ("POST /reset_prefix_cache", lambda: srv.request("POST", "/reset_prefix_cache?reset_running_requests=true")),
                   ("vLLM /pause (abort, clear_cache)", lambda: srv.request("POST", "/pause")),
                   ("vLLM /pause?mode=wait&clear_cache=true", lambda: srv.request("POST", "/pause?mode=wait&clear_cache=true"))):
    c1, out1 = cached()  # the prefix is cached now
    st, r, _ = call()
    if st != 200:
        reflib.fail(f"{what}: {st} {r}")
    if what.startswith("vLLM /pause"):
        srv.request("POST", "/resume")
    c2, out2 = cached()
    if c1 < 48 or c2 != 0 or not same(out1, ref_out) or not same(out2, ref_out):
        reflib.fail(f"{what}: cached tokens {c1} before, {c2} after (want >= 48, then 0); outputs: {ref_out} "
                    f"{out1} {out2}")
c1, _ = cached()
srv.request("POST", "/pause?mode=keep&clear_cache=true")
srv.request("POST", "/resume")
c2, out2 = cached()
if c1 < 48 or c2 < 48 or not same(out2, ref_out):
    reflib.fail(f"vLLM /pause?mode=keep cleared the prefix cache: {c1} -> {c2}")
st, r, _ = srv.request("POST", "/reset_prefix_cache?reset_running_requests=maybe")
if st != 400 or "reset_running_requests" not in json.dumps(r):
    reflib.fail(f"/reset_prefix_cache?reset_running_requests=maybe: {st} {r}")
print(f"ok  prefix cache emptied by /flush_cache, /reset_prefix_cache and vLLM's /pause (abort, wait), kept by "
      f"/pause?mode=keep: cached prompt tokens {c1} -> 0 each time, the same tokens and logprobs (within 1e-4)")
for bad, frag in (({"groups": []}, "groups"), ({"groups": [{"input_ids": [10 ** 9]}]}, "token id"),
                  ({"groups": [{"input_ids": [1, 2]}], "adapter": "nope"}, "nope"),
                  ({"groups": [{"input_ids": [1, 2], "n": 2, "continue_from": {"output_ids": [3]}}]}, "n = 1"),
                  ({"groups": [{"input_ids": [1]}], "sampling": {"logprobs": {"mode": "weird"}}}, "mode")):
    st, r, _ = srv.request("POST", "/v1/rollout", bad)
    if st not in (400, 404) or frag not in r["error"]["message"]:
        reflib.fail(f"bad rollout {bad}: {st} {r}")
print("ok  bad rollout requests get 4xx error objects")
if srv.stop() != 0:
    reflib.fail("exit status")
