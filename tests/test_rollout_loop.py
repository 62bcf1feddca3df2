"""test_rollout_loop.py: versioned adapters and the trainer loop.

1. PUT /v1/adapters/NAME/versions/V with the raw adapter_model.safetensors (r and
   target_modules read from the tensors, lora_alpha from the query) and with {"path"} under
   --lora-root; a rollout on each version reports it, and its logprobs equal transformers +
   peft with that version's weights; an older or equal version is refused (409); the active
   version cannot be deleted; GET /v1/adapters; apply=abort_inflight aborts the rollout running
   on the adapter (its samples come back partial, on the old version).
   Versions 20..39 uploaded while rollouts run: no request fails, every sample's reported
   version is the one whose weights produced its logprobs.
2. rollout_api/examples/grpo_loop.py runs 5 GRPO steps against the server with the stdlib
   client: every step rolls out on the version pushed by the step before, and the server's
   logprobs equal the trainer's (transformers + peft) within 1e-4."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from serverlib import Server, make_tok_model, wait_for  # noqa: E402

sys.path.insert(0, os.path.join(reflib.SRCDIR, "rollout_api", "clients", "python"))
from caraserve_rollout import Client, RolloutError  # noqa: E402

torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4

model_dir, ref_base, _ = make_tok_model("spm-32k", seed=9)
root = reflib.tmpdir("cs_vroot_")
v_dirs, v_refs = [], []
for k in range(3):
    d, ref = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj", "o_proj"], seed=50 + k)
    shutil.copytree(d, os.path.join(root, f"v{k}"))
    v_dirs.append(os.path.join(root, f"v{k}"))
    v_refs.append(ref)
upload_dir = reflib.tmpdir("cs_uploads_")
srv = Server(["--model", model_dir, "--threads", "2", "--kv-cache-bytes", "64M", "--lora-root", root,
              "--adapter-upload-dir", upload_dir])
cl = Client(srv.base)
PROMPT = [1, 500, 600, 700, 800, 900]


def check(version, ref, what):
    out = cl.rollout([{"input_ids": PROMPT, "n": 2, "seed": 3}], adapter="pol",
                     sampling={"max_tokens": 8, "temperature": 1.0, "ignore_eos": True})
    for s in out["groups"][0]["samples"]:
        if s["adapter_version"] != version:
            reflib.fail(f"{what}: sample version {s['adapter_version']}, want {version}")
        with torch.no_grad():
            logits = ref(torch.tensor([PROMPT + s["output_ids"]])).logits[0].double().numpy()
        ls = reflib.log_softmax64(logits)
        worst = max(abs(lp - ls[len(PROMPT) + k - 1][t]) for k, (t, lp) in enumerate(zip(s["output_ids"], s["logprobs"])))
        if worst > TOL:
            reflib.fail(f"{what}: logprobs differ from peft with version {version}'s weights by {worst:.2e}")


def refused(status, what, call):
    """CALL() must be refused with HTTP STATUS (a RolloutError); the test fails, naming WHAT,
    otherwise. Returns the error."""
    try:
        call()
    except RolloutError as e:
        if e.status != status:
            reflib.fail(f"{what}: {e}")
        return e
    reflib.fail(f"{what} must be refused")


with open(os.path.join(v_dirs[0], "adapter_model.safetensors"), "rb") as f:
    r = cl.push_adapter("pol", 3, f.read(), lora_alpha=16)
if r["version"] != 3 or r["active_version"] != 3 or r["bytes"] <= 0:
    reflib.fail(f"push raw: {r}")
check(3, v_refs[0], "raw upload v3")
r = cl.push_adapter("pol", 10, path=v_dirs[1], keep_versions=2)
if r["kept_versions"] != [3, 10]:
    reflib.fail(f"keep_versions=2: {r}")
check(10, v_refs[1], "path upload v10")
for bad_v in (10, 4):
    refused(409, f"version {bad_v} after 10", lambda: cl.push_adapter("pol", bad_v, path=v_dirs[2]))
refused(409, "deleting the active version", lambda: cl._call("DELETE", "/v1/adapters/pol/versions/10"))
v3_dirs = glob.glob(os.path.join(upload_dir, "pol", "v3-*"))
if len(v3_dirs) != 1 or not os.path.exists(os.path.join(v3_dirs[0], "adapter_model.safetensors")):
    reflib.fail(f"the raw upload of version 3 should be stored while it is kept: {v3_dirs}")
if cl._call("DELETE", "/v1/adapters/pol/versions/3")["deleted"] is not True:
    reflib.fail("delete an old version")
if os.path.exists(v3_dirs[0]):
    reflib.fail("a deleted uploaded version's files must be removed")
# a refused upload of a kept version's number leaves that version's files as they were
with open(os.path.join(v_dirs[2], "adapter_model.safetensors"), "rb") as f:
    other = f.read()
before = {d: open(os.path.join(d, "adapter_model.safetensors"), "rb").read()
          for d in glob.glob(os.path.join(upload_dir, "pol", "v*"))}
refused(409, "re-uploading version 10", lambda: cl.push_adapter("pol", 10, other, lora_alpha=16))
after = {d: open(os.path.join(d, "adapter_model.safetensors"), "rb").read()
         for d in glob.glob(os.path.join(upload_dir, "pol", "v*"))}
if after != before:
    reflib.fail("a refused upload changed or left files in the upload directory")
refused(404, "deleting a version no longer kept", lambda: cl._call("DELETE", "/v1/adapters/pol/versions/3"))
ad = cl.adapters()
if [(a["name"], a["active_version"]) for a in ad] != [("pol", 10)]:
    reflib.fail(f"GET /v1/adapters: {ad}")
# apply=abort_inflight: the running rollout on the old version is cut short
# held running with tokens generated (engine paused) when the upload comes: cut short by construction
th, res = srv.hold_call(lambda: cl.rollout([{"input_ids": PROMPT, "n": 2}], adapter="pol",
                                           sampling={"max_tokens": 1000, "ignore_eos": True}),
                        "the rollout on version 10")
r = cl.push_adapter("pol", 11, path=v_dirs[2], apply="abort_inflight")
th.join()
srv.resume()
s0 = res[0]["groups"][0]["samples"]
if r["aborted_requests"] != 1 or [s["finish_reason"] for s in s0] != ["abort", "abort"] or \
        {s["adapter_version"] for s in s0} != {10} or not all(0 < len(s["output_ids"]) < 1000 for s in s0):
    reflib.fail(f"apply=abort_inflight: {r} {[(s['finish_reason'], s['adapter_version'], len(s['output_ids'])) for s in s0]}")
check(11, v_refs[2], "after abort_inflight v11")
print("ok  versioned uploads (raw safetensors and path), each version's rollouts equal peft with its weights; "
      "older versions refused; active version not deletable; apply=abort_inflight")

# ---- kept versions: pinning, staging, activating, keep_versions, pause_keep ----
def ref_of(v):  # the "pin" adapter's version v has v_dirs[(v - 1) % 3]'s weights
    return v_refs[(v - 1) % 3]


def check_sample(s, ref, p, what):
    with torch.no_grad():
        ls = reflib.log_softmax64(ref(torch.tensor([p + s["output_ids"]])).logits[0].double().numpy())
    worst = max(abs(lp - ls[len(p) + k - 1][t]) for k, (t, lp) in enumerate(zip(s["output_ids"], s["logprobs"])))
    if worst > TOL:
        reflib.fail(f"{what}: logprobs differ from peft by {worst:.2e}")


def roll_pin(version=None, max_tokens=8, n=2):
    a = {"name": "pin", "version": version} if version else "pin"
    return cl.rollout([{"input_ids": PROMPT, "n": n, "seed": 5}], adapter=a,
                      sampling={"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True})


cl.push_adapter("pin", 1, path=v_dirs[0], keep_versions=3)
cl.push_adapter("pin", 2, path=v_dirs[1])
r = cl.push_adapter("pin", 3, path=v_dirs[2], activate=False)
if r["active_version"] != 2 or r["kept_versions"] != [1, 2, 3]:
    reflib.fail(f"staged version 3: {r}")
ad = {a["name"]: a for a in cl.adapters()}["pin"]
if [(v["version"], v["active"]) for v in ad["versions"]] != [(1, False), (2, True), (3, False)]:
    reflib.fail(f"GET /v1/adapters versions: {ad}")
for want, pin in ((2, None), (1, 1), (3, 3), (2, 2)):
    for s in roll_pin(pin)["groups"][0]["samples"]:
        if s["adapter_version"] != want or s["version_spans"] != [[0, 8, want, 1]]:
            reflib.fail(f"pinned {pin}: sample on version {s['adapter_version']} spans {s['version_spans']}, want {want}")
        check_sample(s, ref_of(want), PROMPT, f"pinned version {pin}")
e = refused(404, "pinning a version that is not kept", lambda: roll_pin(7))
if "kept versions: 1, 2, 3" not in str(e):
    reflib.fail(f"pin to version 7: {e}")
r = cl.activate_adapter("pin", 3)
if r["active_version"] != 3:
    reflib.fail(f"activate staged version 3: {r}")
for s in roll_pin()["groups"][0]["samples"]:
    if s["adapter_version"] != 3:
        reflib.fail("after activating 3, unpinned requests must run on it")
# a pinned rollout is not cut by apply=abort_inflight, and goes on with its own version
th, res = srv.hold_call(lambda: roll_pin(1, max_tokens=200, n=1), "the pinned rollout")
r = cl.push_adapter("pin", 4, path=v_dirs[0], apply="abort_inflight")
srv.resume()
th.join()
s = res[0]["groups"][0]["samples"][0]
if r["aborted_requests"] != 0 or s["finish_reason"] != "length" or s["version_spans"] != [[0, 200, 1, 1]]:
    reflib.fail(f"pinned rollout during abort_inflight: {r} {s['finish_reason']} {s['version_spans']}")
check_sample(s, ref_of(1), PROMPT, "pinned rollout during an upload")
# a pinned request holds its version from submission on: queued behind a pause while an upload
# with keep_versions=1 drops every other version, it still runs on version 3 afterwards (version 1's pinned
# rollout above kept it through the upload of 4, so 2 was the one dropped then)
cl._call("POST", "/v1/pause", {"mode": "keep"})
res = []
th = threading.Thread(target=lambda: res.append(roll_pin(3)))
th.start()
wait_for(lambda: srv.metrics()[1]["caraserve_num_requests_waiting"] >= 1, 120, "the pinned rollout to queue")
r = cl.push_adapter("pin", 5, path=v_dirs[1], keep_versions=1)
refused(409, "deleting a version a queued request is pinned to", lambda: cl.delete_adapter_version("pin", 3))
cl._call("POST", "/v1/resume", {})
th.join()
if r["kept_versions"] != [3, 5]:
    reflib.fail(f"keep_versions=1 with a request pinned to version 3: {r}")
for s in res[0]["groups"][0]["samples"]:
    if s["finish_reason"] != "length" or s["version_spans"] != [[0, 8, 3, 1]]:
        reflib.fail(f"the queued pinned request: {s['finish_reason']} {s['version_spans']}")
    check_sample(s, ref_of(3), PROMPT, "a pinned request queued across an upload")
cl.delete_adapter_version("pin", 3)
if [v["version"] for v in {a["name"]: a for a in cl.adapters()}["pin"]["versions"]] != [5]:
    reflib.fail("keep_versions=1: only version 5 should be left")
# apply=pause_keep: a running greedy rollout goes on with version 6's weights over the KV its
# first tokens left under version 5; version_spans says where. The reference builds the same
# thing in transformers: version 5's cache up to the switch, version 6 from there. The trainer's
# sequence (pause keep, upload, resume) makes the switch land mid-sample whatever the timing.
body_pk = {"adapter": "pin", "sampling": {"max_tokens": 300, "temperature": 0, "ignore_eos": True},
           "groups": [{"input_ids": PROMPT}]}
# its first tokens are out; paused (keep)
th, res = srv.hold_call(lambda: cl._call("POST", "/v1/rollout", body_pk), "the rollout on version 5")
r = cl.push_adapter("pin", 6, path=v_dirs[2], apply="pause_keep")
cl._call("POST", "/v1/resume", {})
th.join()
s = res[0]["groups"][0]["samples"][0]
sp = s["version_spans"]
if r["moved_requests"] != 1 or len(sp) != 2 or sp[0][2] != 5 or sp[1][2] != 6 or sp[0][0] != 0 or         sp[0][1] != sp[1][0] or sp[1][1] != 300 or not 0 < sp[0][1] < 300 or s["adapter_version"] != 6:
    reflib.fail(f"apply=pause_keep: {r} spans {sp} version {s['adapter_version']}")
k, ids = sp[0][1], s["output_ids"]
with torch.no_grad():
    la = reflib.log_softmax64(ref_of(5)(torch.tensor([PROMPT + ids[:k]])).logits[0].double().numpy())
    cache = ref_of(5)(torch.tensor([PROMPT + ids[:k - 1]]), use_cache=True).past_key_values
    lb = reflib.log_softmax64(ref_of(6)(torch.tensor([ids[k - 1:]]), past_key_values=cache).logits[0].double().numpy())
worst = 0.0
for j, (t, lp) in enumerate(zip(ids, s["logprobs"])):
    row = la[len(PROMPT) + j - 1] if j < k else lb[j - k]
    worst = max(worst, abs(lp - row[t]))
    if row.max() - row[t] > TOL:
        reflib.fail(f"pause_keep: greedy token {j} is not the reference's argmax")
if worst > TOL:
    reflib.fail(f"pause_keep: logprobs differ from the mixed-version reference by {worst:.2e}")
print(f"ok  kept versions: pinned rollouts (old, active, staged) equal peft with that version's weights; a version not "
      f"kept is refused (404); activation of a staged version; pinned rollouts survive abort_inflight and, queued, an "
      f"upload that drops their version's siblings (DELETE of it: 409); "
      f"keep_versions trims; apply=pause_keep moves a running sample at token {k}: spans {sp}, logprobs equal "
      f"transformers with version 5's KV then version 6's weights (max |diff| {worst:.1e})")

# versions 20..39 uploaded one after another while rollouts run: no request fails, and every
# sample's reported version is the one whose weights produced its logprobs
vers = {}
for k in range(20):
    d, ref = make_adapter(model_dir, ref_base, r=4, alpha=8, targets=["q_proj", "o_proj"], seed=200 + k)
    dst = os.path.join(root, f"s{k}")
    shutil.copytree(d, dst)
    vers[20 + k] = (dst, ref)
results, errors = [], []


def roll(i):
    try:
        results.append((i, cl.rollout([{"input_ids": PROMPT, "n": 2, "seed": i}, {"input_ids": PROMPT[:3], "seed": 99}],
                                      adapter="upd", sampling={"max_tokens": 10, "temperature": 1.0,
                                                               "ignore_eos": True})))
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))


cl.push_adapter("upd", 19, path=v_dirs[0])
vers[19] = (v_dirs[0], v_refs[0])
# rollout i is sent right after version 20+i is pushed; the odd ones run on while the next
# versions upload, the even ones end before the next upload (so those run on 20+i alone, which
# makes the versions seen many by construction, not by timing)
threads = []
for k in range(20):
    cl.push_adapter("upd", 20 + k, path=vers[20 + k][0])
    if k < 12:
        t = threading.Thread(target=roll, args=(k,))
        t.start()
        threads.append(t)
        if k % 2 == 0:
            t.join()
for t in threads:
    t.join()
if errors:
    reflib.fail(f"rollouts failed during uploads: {errors[:3]}")
seen = {}
for i, out in results:
    for g in out["groups"]:
        if i % 2 == 0 and any(s["adapter_version"] != 20 + i for s in g["samples"]):
            reflib.fail(f"rollout {i}, sent after version {20 + i} and done before the next upload, reported "
                        f"{[s['adapter_version'] for s in g['samples']]}")
        p = PROMPT if len(g["samples"]) == 2 else PROMPT[:3]
        for s in g["samples"]:
            v = s["adapter_version"]
            seen[v] = seen.get(v, 0) + 1
            with torch.no_grad():
                logits = vers[v][1](torch.tensor([p + s["output_ids"]])).logits[0].double().numpy()
            ls = reflib.log_softmax64(logits)
            worst = max(abs(lp - ls[len(p) + k - 1][t]) for k, (t, lp) in enumerate(zip(s["output_ids"], s["logprobs"])))
            if worst > TOL:
                reflib.fail(f"a sample reported version {v} but its logprobs are not that version's ({worst:.2e})")
if len(seen) < 6:
    reflib.fail(f"the rollouts saw only versions {sorted(seen)}")
print(f"ok  20 uploads while 12 rollouts ran: none failed; {sum(seen.values())} samples over {len(seen)} versions, each "
      "equal to peft with the weights of the version it reports")

# ---- 2. the example trainer loop ----
p = subprocess.run([sys.executable, os.path.join(reflib.SRCDIR, "rollout_api", "examples", "grpo_loop.py"),
                    "--server", srv.base, "--model", model_dir, "--adapter", "grpo", "--steps", "5", "--groups", "3",
                    "--n", "4", "--max-tokens", "8"], capture_output=True, text=True, timeout=900)
steps = re.findall(r"step +(\d+) +version (\S+) +reward (\S+) .* logprob\| (\S+) +-> pushed v(\d+)", p.stdout)
if p.returncode != 0 or len(steps) != 5:
    reflib.fail(f"grpo_loop.py: exit {p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}")
for i, (st, ver, rew, diff, pushed) in enumerate(steps):
    if ver != str(i + 1) or int(pushed) != i + 2 or float(diff) > TOL:
        reflib.fail(f"grpo step {st}: rollout version {ver}, pushed {pushed}, mismatch {diff}")
print(f"ok  grpo_loop.py: 5 steps, each on the version pushed before it, server/trainer logprob mismatch "
      f"<= {max(float(s[3]) for s in steps):.1e}")
if srv.stop() != 0:
    reflib.fail("exit status")

# ---- 3. without --adapter-upload-dir the uploads go to a directory of the server's own, in
# $TMPDIR, which it removes with its contents when it stops ----
tmp = reflib.tmpdir("cs_tmpdir_")
srv = Server(["--model", model_dir, "--threads", "2", "--kv-cache-bytes", "64M"], env={"TMPDIR": tmp})
cl = Client(srv.base)
with open(os.path.join(v_dirs[1], "adapter_model.safetensors"), "rb") as f:
    cl.push_adapter("own", 1, f.read(), lora_alpha=16)
made = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
if not any(os.path.relpath(m, tmp).split(os.sep)[0].startswith("caraserve-uploads-") for m in made):
    reflib.fail(f"the upload should be stored under $TMPDIR/caraserve-uploads-*: found {made}")
if srv.stop() != 0:
    reflib.fail("exit status")
if os.listdir(tmp):
    reflib.fail(f"the server's own upload directory outlived it: {os.listdir(tmp)}")
print("ok  the default upload directory is made in $TMPDIR and removed, with the uploads, when the server stops")
