"""test_base_weights.py: the base weights replaced while the server runs, as RL frameworks
that train every weight do it, judged by transformers on each checkpoint.

1. Refusals change nothing: another shape (400 naming the field), a truncated file (400), a
   missing directory (404), SGLang's body with a bad path (400, success false); a rollout held
   running through them finishes with the old weights' logprobs.
2. AReaL's update (pause_generation, update_weights_from_disk {model_path, weight_version,
   abort_all_requests, flush_cache}, continue_generation); slime's reads (get_weight_version,
   get_model_info, /generate meta_info.weight_version, abort_request + /v1/loads, health_generate):
   the rollout after it is transformers' on the new weights within 1e-4 and equals, bit for
   bit, a fresh server started on them (--batch-invariant).
3. A version kept beside (keep_versions 2): a request pinned to the old one gets the old
   weights' logprobs exactly.
4. In place with apply=pause_keep: a running rollout goes on with the new weights; its
   version_spans say from which token, and every logprob is transformers' (the old weights'
   KV up to there, the new ones' after).
5. The routes a C server cannot speak (update_weights_from_tensor, ..._distributed) are 501
   naming update_weights_from_disk.
6. vLLM's /sleep (level 1 with a rollout kept running through it, level 2), /wake_up by tags,
   /is_sleeping, /abort_requests by id.
7. SGLang's /load_lora_adapter and /unload_lora_adapter with AReaL's body, /update_weight_version.
8. rollout_api/examples/grpo_full.py (every weight trained, each step saved and loaded through
   /update_weights_from_disk): every rollout on the weights of the step before, the server's
   logprobs equal to the trainer's within 1e-4."""
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

torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4
PROMPT = [1, 500, 600, 700, 800, 900]

root = reflib.tmpdir("cs_wroot_")
dirs, refs = {}, {}
for name, seed, hidden in (("a", 9, 64), ("b", 21, 64), ("wide", 5, 128)):
    d, ref, _ = make_tok_model("spm-32k", seed=seed, hidden=hidden)
    dirs[name] = os.path.join(root, name)
    shutil.copytree(d, dirs[name])
    refs[name] = ref
dirs["cut"] = os.path.join(root, "cut")
shutil.copytree(dirs["b"], dirs["cut"])
with open(os.path.join(dirs["cut"], "model.safetensors"), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(dirs["b"], "model.safetensors")) - 4096)

ARGS = ["--threads", "2", "--kv-cache-bytes", "64M", "--batch-invariant"]
srv = Server(["--model", dirs["a"], "--lora-root", root] + ARGS)


def rollout(s, max_tokens=8, **kw):
    body = {"sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True},
            "groups": [{"input_ids": PROMPT}], **kw}
    st, out, _ = s.request("POST", "/v1/rollout", body)
    if st != 200:
        reflib.fail(f"rollout: {st} {out}")
    return out["groups"][0]["samples"][0]


def worst_vs(ref, sample):
    ids = sample["output_ids"]
    with torch.no_grad():
        lp = reflib.log_softmax64(ref(torch.tensor([PROMPT + ids])).logits[0].double().numpy())
    return max(abs(sample["logprobs"][j] - lp[len(PROMPT) + j - 1][t]) for j, t in enumerate(ids))


def versions():
    st, out, _ = srv.request("GET", "/v1/weights")
    return [(v["version"], v["weight_version"], v["active"]) for v in out["versions"]]


# 1. refusals, with a rollout held running through them
s0 = rollout(srv)
if worst_vs(refs["a"], s0) > TOL or s0["base_version"] != 1:
    reflib.fail(f"before any update: base_version {s0['base_version']}, |dlogprob| {worst_vs(refs['a'], s0)}")
th, res = srv.hold_call(lambda: rollout(srv, max_tokens=300), "a long rollout on the first weights")
bad = [({"path": dirs["wide"]}, 400, "hidden_size: 64 in the served model, 128 in the new one"),
       ({"path": dirs["cut"]}, 400, "exceed"),
       ({"path": os.path.join(root, "nowhere")}, 404, "does not exist"),
       ({"path": "/etc"}, 403, "outside"),
       ({"path": dirs["b"], "apply": "sometimes"}, 400, "apply is"),
       ({"path": dirs["b"], "load": "elsewhere"}, 400, "load is")]
for body, status, words in bad:
    st, out, _ = srv.request("POST", "/v1/weights", body)
    if st != status or words not in out["error"]["message"]:
        reflib.fail(f"POST /v1/weights {body}: {st} {out}, want {status} with '{words}'")
st, out, _ = srv.request("POST", "/update_weights_from_disk", {"model_path": dirs["cut"], "weight_version": "x"})
if st != 400 or out["success"] is not False or "exceed" not in out["message"] or out["num_paused_requests"] != 0:
    reflib.fail(f"/update_weights_from_disk, a truncated file: {st} {out}")
if versions() != [(1, "default", True)]:
    reflib.fail(f"a refused update changed the versions: {versions()}")
srv.resume()
th.join()
held = res[0]
if len(held["output_ids"]) != 300 or held["version_spans"] != [[0, 300, 0, 1]] or worst_vs(refs["a"], held) > TOL:
    reflib.fail(f"the held rollout: {len(held['output_ids'])} tokens, spans {held['version_spans']}")
print(f"ok  {len(bad) + 1} refused updates changed nothing; a rollout running through them kept the first weights")

# 2. AReaL's update sequence, then what slime reads
for path, body in (("/pause_generation", {"mode": "abort"}),
                   ("/update_weights_from_disk", {"model_path": dirs["b"], "weight_version": "1",
                                                  "abort_all_requests": True, "flush_cache": True}),
                   ("/continue_generation", {})):
    st, out, _ = srv.request("POST", path, body)
    if st != 200:
        reflib.fail(f"{path}: {st} {out}")
    if path == "/update_weights_from_disk" and (out["success"] is not True or out["num_paused_requests"] != 0 or
                                                out["message"] != "Succeeded to update model weights. Weight version updated to 1."):
        reflib.fail(f"{path}: {out}")
st, out, _ = srv.request("GET", "/get_weight_version")
if st != 200 or out != {"weight_version": "1"}:
    reflib.fail(f"/get_weight_version: {st} {out}")
st, out, _ = srv.request("GET", "/get_model_info")
if st != 200 or out["model_path"] != dirs["b"] or out["weight_version"] != "1" or out["is_generation"] is not True:
    reflib.fail(f"/get_model_info: {st} {out}")
s1 = rollout(srv)
w1 = worst_vs(refs["b"], s1)
if w1 > TOL or s1["base_version"] != 2 or s1["version_spans"] != [[0, 8, 0, 2]]:
    reflib.fail(f"after the update: base_version {s1['base_version']}, spans {s1['version_spans']}, |dlogprob| {w1}")
st, gen, _ = srv.request("POST", "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True}})
if st != 200 or gen["meta_info"]["weight_version"] != "1" or gen["output_ids"] != s1["output_ids"]:
    reflib.fail(f"/generate after the update: {st} {gen}")
# slime ends a step with /abort_request {"abort_all": true}, then polls /v1/loads until no
# request is left (the engine publishes its counts after each iteration)
st, _, _ = srv.request("POST", "/abort_request", {"abort_all": True})
seen = []


def idle():
    st2, loads, _ = srv.request("GET", "/v1/loads?include=core")
    seen.append((st2, loads))
    one = loads["loads"][0]
    return st2 == 200 and one["num_running_reqs"] + one["num_waiting_reqs"] == 0 and loads["aggregate"]["total_reqs"] == 0


wait_for(idle, 60, "/v1/loads to say idle")
if st != 200 or set(seen[-1][1]["loads"][0]) < {"num_running_reqs", "num_waiting_reqs", "num_total_reqs", "token_usage"}:
    reflib.fail(f"/abort_request then /v1/loads: {st} {seen[-1]}")
st, _, _ = srv.request("GET", "/health_generate")
if st != 200:
    reflib.fail(f"/health_generate: {st}")
st, info, _ = srv.request("GET", "/get_server_info")
if st != 200 or info["weight_version"] != "1" or info["model_path"] != dirs["a"]:
    reflib.fail(f"/get_server_info: {st} {info}")
fresh = Server(["--model", dirs["b"]] + ARGS)
f1 = rollout(fresh)
fresh.stop()
if f1["output_ids"] != s1["output_ids"] or f1["logprobs"] != s1["logprobs"]:
    reflib.fail(f"after the update vs a fresh server on the new weights: {s1['logprobs']} != {f1['logprobs']}")
print(f"ok  AReaL's update and slime's reads; the rollout after it: |dlogprob| {w1:.1e} against transformers, "
      "bit-identical to a fresh server on the new weights")

# 3. beside, two kept: a request pinned to the old version keeps the old weights
st, out, _ = srv.request("POST", "/v1/weights", {"path": dirs["a"], "weight_version": "2", "keep_versions": 2,
                                                  "load": "beside"})
if st != 200 or out["version"] != 3 or out["load"] != "beside" or out["weight_version"] != "2":
    reflib.fail(f"POST /v1/weights beside: {st} {out}")
if versions() != [(3, "2", True), (2, "1", False)]:
    reflib.fail(f"versions after a beside update keeping 2: {versions()}")
s3 = rollout(srv)
s2 = rollout(srv, base_version=2)
if s3["base_version"] != 3 or worst_vs(refs["a"], s3) > TOL or s3["logprobs"] != s0["logprobs"]:
    reflib.fail(f"version 3 (the first weights again): {s3}")
if s2["base_version"] != 2 or s2["logprobs"] != s1["logprobs"]:
    reflib.fail(f"pinned to version 2: {s2}")
st, out, _ = srv.request("POST", "/v1/rollout", {"base_version": 1, "groups": [{"input_ids": PROMPT}]})
if st != 404 or "not held" not in out["error"]["message"]:
    reflib.fail(f"pinned to a version no longer held: {st} {out}")
print("ok  beside, keep_versions 2: the pinned request got the old weights' logprobs exactly; a dropped version is 404")

# 4. in place with pause_keep: the running rollout moves to the new weights mid-sample
th, res = srv.hold_call(lambda: rollout(srv, max_tokens=300), "a long rollout on version 3")
st, out, _ = srv.request("POST", "/v1/weights", {"path": dirs["b"], "apply": "pause_keep", "load": "in_place"})
srv.resume()
th.join()
if st != 200 or out["load"] != "in_place" or out["moved_requests"] != 1 or out["version"] != 4:
    reflib.fail(f"in place, pause_keep: {st} {out}")
s = res[0]
sp, ids = s["version_spans"], s["output_ids"]
if len(sp) != 2 or sp[0][3] != 3 or sp[1][3] != 4 or sp[0][1] != sp[1][0] or not 0 < sp[0][1] < 300 or \
        s["base_version"] != 4 or len(ids) != 300:
    reflib.fail(f"pause_keep spans {sp}, base_version {s['base_version']}")
k = sp[0][1]
with torch.no_grad():
    la = reflib.log_softmax64(refs["a"](torch.tensor([PROMPT + ids[:k]])).logits[0].double().numpy())
    cache = refs["a"](torch.tensor([PROMPT + ids[:k - 1]]), use_cache=True).past_key_values
    lb = reflib.log_softmax64(refs["b"](torch.tensor([ids[k - 1:]]), past_key_values=cache).logits[0].double().numpy())
worst = max(abs(lp - (la[len(PROMPT) + j - 1] if j < k else lb[j - k])[t]) for j, (t, lp) in enumerate(zip(ids, s["logprobs"])))
if worst > TOL:
    reflib.fail(f"pause_keep: |dlogprob| {worst} against transformers (the old KV up to token {k}, the new weights after)")
if [v for v, _, _ in versions()] != [4]:  # keep_versions 1: version 2 goes
    reflib.fail(f"versions after the in-place update: {versions()}")
print(f"ok  in place, pause_keep: switched at token {k} of 300, |dlogprob| {worst:.1e} against transformers")

# 5. what a C server cannot speak
for path in ("/update_weights_from_tensor", "/update_weights_from_distributed", "/init_weights_update_group"):
    st, out, _ = srv.request("POST", path, {"names": []})
    if st != 501 or out["success"] is not False or "/update_weights_from_disk" not in out["message"]:
        reflib.fail(f"{path}: {st} {out}")
print("ok  update_weights_from_tensor / _distributed / init_weights_update_group: 501 naming update_weights_from_disk")

# 6. vLLM's sleep and wake-up, and /abort_requests
th, res = srv.hold_call(lambda: rollout(srv, max_tokens=300), "a long rollout to sleep through")
for method, path, want in (("POST", "/sleep?level=1&mode=keep", ""), ("GET", "/is_sleeping", {"is_sleeping": True}),
                           ("GET", "/v1/loads", None), ("POST", "/wake_up", ""),
                           ("GET", "/is_sleeping", {"is_sleeping": False})):
    st, out, _ = srv.request(method, path)
    if st != 200 or (want is not None and out != want) or \
            (path == "/v1/loads" and out["loads"][0]["max_total_num_tokens"] != 0):
        reflib.fail(f"{method} {path}: {st} {out}")
th.join()
s = res[0]
if len(s["output_ids"]) != 300 or s["version_spans"] != [[0, 300, 0, 4]] or worst_vs(refs["b"], s) > TOL:
    reflib.fail(f"the rollout slept through (its KV recomputed): {len(s['output_ids'])} tokens, "
                f"|dlogprob| {worst_vs(refs['b'], s)}")
for method, path, want in (("POST", "/sleep?level=2", ""), ("POST", "/wake_up?tags=kv_cache", ""),
                           ("GET", "/is_sleeping", {"is_sleeping": True}), ("GET", "/health_generate", None),
                           ("POST", "/v1/weights", None), ("POST", "/wake_up?tags=weights", ""),
                           ("GET", "/is_sleeping", {"is_sleeping": False}), ("POST", "/sleep?level=3", None),
                           ("POST", "/wake_up?tags=everything", None)):
    st, out, _ = srv.request(method, path, {"path": dirs["a"]} if path == "/v1/weights" else None)
    bad = {"/health_generate": 503, "/v1/weights": 400, "/sleep?level=3": 400, "/wake_up?tags=everything": 400}
    if st != bad.get(path, 200) or (want is not None and out != want):
        reflib.fail(f"{method} {path}: {st} {out}")
s = rollout(srv)
if s["logprobs"] != s1["logprobs"] or s["base_version"] != 4:
    reflib.fail(f"after sleep level 2 and the weights loaded again: {s}")
th, res = srv.hold_call(lambda: rollout(srv, max_tokens=300, batch_id="long-1"), "a rollout to abort")
st, out, _ = srv.request("POST", "/abort_requests", {"request_ids": ["long-1"]})
srv.resume()
th.join()
if st != 200 or out != {"status": "aborted", "aborted": 1} or res[0]["finish_reason"] != "abort":
    reflib.fail(f"/abort_requests by id: {st} {out} {res[0]['finish_reason']}")
st, out, _ = srv.request("POST", "/abort_requests", {"request_ids": "long-1"})
if st != 400:
    reflib.fail(f"/abort_requests with a string: {st} {out}")
print("ok  vLLM's /sleep (level 1 with a running rollout kept; level 2), /wake_up by tags, /is_sleeping, "
      "/abort_requests: the rollout slept through finished on transformers' logprobs, level 2 gave the same bits back")

# 7. SGLang's adapter routes (AReaL's body: a versioned name, a path under the root) and
# /update_weight_version
ad_dir, ad_ref = make_adapter(dirs["b"], refs["b"], r=8, alpha=16, targets=["q_proj", "v_proj"], seed=3)
shutil.copytree(ad_dir, os.path.join(root, "lora-v1"))
st, out, _ = srv.request("POST", "/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": os.path.join(root, "lora-v1")})
if st != 200 or out != {"success": True, "error_message": None,
                        "loaded_adapters": {"pol-v1": os.path.join(root, "lora-v1")}}:
    reflib.fail(f"/load_lora_adapter: {st} {out}")
sa = rollout(srv, adapter="pol-v1")
wa = worst_vs(ad_ref, sa)
if wa > TOL or sa["adapter_version"] != 1:
    reflib.fail(f"a rollout on the adapter /load_lora_adapter loaded: |dlogprob| {wa}, {sa}")
for body, words in (({"lora_name": "x", "lora_path": "/etc"}, "outside"),
                    ({"lora_name": "x", "lora_path": os.path.join(root, "lora-v1"), "pinned": True}, "pinned"),
                    ({"lora_path": os.path.join(root, "lora-v1")}, "required")):
    st, out, _ = srv.request("POST", "/load_lora_adapter", body)
    if st != 400 or out["success"] is not False or words not in out["error_message"] or "pol-v1" not in out["loaded_adapters"]:
        reflib.fail(f"/load_lora_adapter {body}: {st} {out}")
st, out, _ = srv.request("POST", "/unload_lora_adapter", {"lora_name": "pol-v1"})
st2, out2, _ = srv.request("POST", "/unload_lora_adapter", {"lora_name": "pol-v1"})
if st != 200 or out != {"success": True, "error_message": None, "loaded_adapters": {}} or st2 != 400 or \
        "cannot be found" not in out2["error_message"]:
    reflib.fail(f"/unload_lora_adapter: {st} {out}; again: {st2} {out2}")
st, out, _ = srv.request("POST", "/update_weight_version", {"new_version": "step-7"})
st2, out2, _ = srv.request("GET", "/get_weight_version")
if st != 200 or out != {"success": True, "message": "Weight version updated to step-7", "new_version": "step-7"} or \
        out2 != {"weight_version": "step-7"}:
    reflib.fail(f"/update_weight_version: {st} {out}; then {out2}")
print(f"ok  SGLang's /load_lora_adapter (a rollout on it: |dlogprob| {wa:.1e} against peft), its refusals (400, "
      "success false), /unload_lora_adapter, /update_weight_version")

# 8. the full-parameter GRPO example: every step's rollout on the weights the step before saved
save_root = os.path.join(root, "grpo")
os.makedirs(save_root)
p = subprocess.run([sys.executable, os.path.join(reflib.SRCDIR, "rollout_api", "examples", "grpo_full.py"),
                    "--server", srv.base, "--model", dirs["b"], "--save-root", save_root, "--steps", "3",
                    "--groups", "2", "--n", "4", "--max-tokens", "8", "--sglang"], capture_output=True, text=True,
                   timeout=900)
steps = re.findall(r"step +(\d+) +version (\S+) +reward (\S+) .* logprob\| (\S+) +-> base v(\d+)", p.stdout)
if p.returncode != 0 or len(steps) != 3:
    reflib.fail(f"grpo_full.py: exit {p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}")
for i, (st, ver, rew, diff, new) in enumerate(steps):
    if ver != str(4 + i) or int(new) != 5 + i or float(diff) > TOL:
        reflib.fail(f"grpo_full step {st}: rollout on base v{ver}, updated to v{new}, mismatch {diff}")
print(f"ok  grpo_full.py (through /update_weights_from_disk): 3 steps, each on the weights saved before it, "
      f"server/trainer logprob mismatch <= {max(float(s[3]) for s in steps):.1e}")
srv.stop()

# 9. --precision int8 on weights quantized at load (on AVX512-VNNI CPUs each matrix is repacked on
# the compute pool as it loads): an update beside, a rollout under way, holds the engine still
# for the load; the rollouts after it equal a fresh server's on the new weights, bit for bit
Q = ["--quantization", "q8_0", "--precision", "int8"] + ARGS
s8 = Server(["--model", dirs["a"], "--lora-root", root] + Q)
before = rollout(s8)
out8 = []
t8 = threading.Thread(target=lambda: out8.append(rollout(s8, max_tokens=200)))
t8.start()
st, out, _ = s8.request("POST", "/v1/weights", {"path": dirs["b"], "load": "beside"})
t8.join()
if st != 200 or out["load"] != "beside" or len(out8) != 1 or len(out8[0]["output_ids"]) != 200:
    reflib.fail(f"int8: POST /v1/weights beside: {st} {out}; the rollout under way: {out8}")
after = rollout(s8)
s8.stop()
fresh8 = Server(["--model", dirs["b"]] + Q)
f8 = rollout(fresh8)
fresh8.stop()
if after["output_ids"] != f8["output_ids"] or after["logprobs"] != f8["logprobs"] or after["logprobs"] == before["logprobs"]:
    reflib.fail(f"int8, after a beside update vs a fresh server on the new weights: {after['logprobs']} != {f8['logprobs']}")
print("ok  --quantization q8_0 --precision int8: an update beside a running rollout; the rollout after it "
      "bit-identical to a fresh server's")
