"""test_tenants.py: one server, many tenants.

1. --lora-modules-dir registers a directory's adapters at start; /v1/models pages them
   (?limit=&after=, has_more, first_id, last_id) and lists all of them without paging.
2. --lora-resolve: a request for an unregistered name that is an adapter in the directory
   registers it and runs on it (logprobs transformers + peft's within 1e-4). Four first
   requests at once register it once (the server holds the first until the other three came:
   CARASERVE_TEST_RESOLVE_GATE). Traversal, a symlink out of --lora-root, a directory that is
   not an adapter, one that does not fit the base model and a name that is not there are all
   the same 404, word for word; the refusals are logged for the operator.
3. --api-keys: a tenant's key uses, lists and pushes only its own adapters; another tenant's
   adapter is answered exactly as one that does not exist (completions, tokenize, rollout,
   SGLang's /generate, /v1/models/{id}, stats, DELETE; PUT is refused alike for both) and is
   not even looked for on disk; a tenant without "base" cannot use the base model; without
   "push" cannot push; every admin route (read from server/routes.c) is 403 for a tenant;
   no key or a wrong one is 401.
4. SIGHUP rereads the key file: a rollout running on a key that the new file drops finishes;
   the dropped key gets 401, the new one works; a malformed file keeps the keys and says why.
5. `caraserve router --api-keys` applies the same file in front of the server and passes the
   request's own key on.
6. /metrics with 1,000 adapters in use and --metrics-max-adapters 10: at most 10 adapters have
   series of their own (plus the base model and _other), promtool finds nothing, and every
   total equals the sum of GET /v1/adapters/NAME/stats over every adapter; an adapter that
   becomes busier than one in the set takes its place at the next scrape, the totals unchanged."""
import json
import os
import re
import shutil
import signal
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
N_MANY = int(os.environ.get("CS_TENANTS_MANY", "1000"))  # fewer under TSan
BOUND = 10

model_dir, ref, _ = make_tok_model("spm-32k", seed=3)
wide_dir, wide_ref, _ = make_tok_model("spm-32k", seed=4, hidden=128)
root = reflib.tmpdir("cs_tenants_")
outside = reflib.tmpdir("cs_tenants_out_")
res_dir, mods_dir, many_dir = (os.path.join(root, d) for d in ("resolve", "mods", "many"))
for d in (res_dir, mods_dir, many_dir):
    os.makedirs(d)
refs = {}
for name, seed in (("acme-a", 11), ("acme-b", 12), ("globex-x", 13)):
    d, refs[name] = make_adapter(model_dir, ref, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=seed)
    shutil.copytree(d, os.path.join(res_dir, name))
small, _ = make_adapter(model_dir, ref, r=4, alpha=8, targets=["q_proj"], seed=14)
for name in ("m1", "m2", "m3"):
    shutil.copytree(small, os.path.join(mods_dir, name))
os.makedirs(os.path.join(mods_dir, "not-one"))  # no adapter_config.json: not listed
for i in range(N_MANY):
    shutil.copytree(small, os.path.join(many_dir, f"t{i:04d}"))
shutil.copytree(small, os.path.join(outside, "evil"))
os.symlink(os.path.join(outside, "evil"), os.path.join(res_dir, "escape"))
os.makedirs(os.path.join(res_dir, "junk"))
with open(os.path.join(res_dir, "junk", "adapter_config.json"), "w") as f:
    f.write('{"r": 8, "peft_type": "LORA"')  # truncated
wide_a, _ = make_adapter(wide_dir, wide_ref, r=4, alpha=8, targets=["q_proj"], seed=15)
shutil.copytree(wide_a, os.path.join(res_dir, "wide"))
shutil.copytree(small, os.path.join(res_dir, ".hidden"))

ADMIN, ACME, GLOBEX, ACME2 = "sk-admin-0001", "sk-acme-00001", "sk-globex-001", "sk-acme-00002"
keys_file = os.path.join(reflib.tmpdir("cs_keys_"), "keys.json")


def write_keys(acme_key):
    with open(keys_file + ".tmp", "w") as f:
        json.dump({"keys": [{"key": ADMIN, "role": "admin"},
                            {"key": acme_key, "role": "tenant", "adapters": ["acme-*", "t*"], "push": True,
                             "name": "acme"},
                            {"key": GLOBEX, "role": "tenant", "adapters": ["globex-*"], "base": True,
                             "name": "globex"}]}, f)
    os.replace(keys_file + ".tmp", keys_file)


def h(key):
    return {"Authorization": f"Bearer {key}"}


write_keys(ACME)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-root", root, "--lora-resolve", res_dir,
              "--lora-resolve", many_dir, "--lora-modules-dir", mods_dir, "--api-keys", keys_file,
              "--metrics-max-adapters", str(BOUND), "--threads", "2", "--kv-cache-bytes", "64M",
              "--batch-invariant", "--max-n", "256"],
             env={"CARASERVE_TEST_RESOLVE_GATE": "acme-a:4"})
srv.auth = h(ADMIN)


def req(method, path, body=None, key=ADMIN):
    return srv.request(method, path, body, headers=h(key))


def rollout(adapter, key, max_tokens=6, groups=None):
    body = {"sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True},
            "groups": groups or [{"input_ids": PROMPT}]}
    if adapter:
        body["adapter"] = adapter
    return req("POST", "/v1/rollout", body, key)


def worst_vs(model, sample):
    ids = sample["output_ids"]
    with torch.no_grad():
        lp = reflib.log_softmax64(model(torch.tensor([PROMPT + ids])).logits[0].double().numpy())
    return max(abs(sample["logprobs"][j] - lp[len(PROMPT) + j - 1][t]) for j, t in enumerate(ids))


def resolutions():
    v = srv.metrics()[1]
    return (v.get('caraserve_lora_resolutions_total{result="registered"}', 0),
            v.get('caraserve_lora_resolutions_total{result="not_found"}', 0))


# 1. --lora-modules-dir and paging
st, out, _ = req("GET", "/v1/models")
ids = [m["id"] for m in out["data"]]
if st != 200 or ids != ["base", "m1", "m2", "m3"] or out["has_more"] or out["last_id"] != "m3":
    reflib.fail(f"/v1/models after --lora-modules-dir: {st} {out}")
pages, after = [], None
while True:
    st, out, _ = req("GET", "/v1/models?limit=2" + (f"&after={after}" if after else ""))
    if st != 200:
        reflib.fail(f"/v1/models paged: {st} {out}")
    pages.append([m["id"] for m in out["data"]])
    if not out["has_more"]:
        break
    after = out["last_id"]
if pages != [["base", "m1"], ["m2", "m3"]]:
    reflib.fail(f"/v1/models two at a time: {pages}")
for q, param in (("limit=0", "limit"), ("limit=x", "limit"), ("after=nobody", "after")):
    st, out, _ = req("GET", "/v1/models?" + q)
    if st != 400 or out["error"]["param"] != param:
        reflib.fail(f"/v1/models?{q}: {st} {out}")
print("ok  --lora-modules-dir registered 3 adapters (a directory without one skipped); /v1/models pages by 2")

# 2. first requests
results = [None] * 4


def first(i):
    try:
        results[i] = rollout("acme-a", ACME)
    except Exception as e:  # the server's log says why
        results[i] = (None, repr(e), None)


threads = [threading.Thread(target=first, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for st, out, _ in results:
    if st != 200:
        reflib.fail(f"a first request for acme-a: {st} {out}\n" + "".join(srv.lines[-60:]))
worst = max(worst_vs(refs["acme-a"], out["groups"][0]["samples"][0]) for _, out, _ in results)
wait_for(lambda: any("adapter 'acme-a' registered" in ln for ln in srv.lines), 30, "the registration's log line")
registered = [ln for ln in srv.lines if "adapter 'acme-a' registered" in ln]
if resolutions()[0] != 1 or len(registered) != 1 or worst > TOL:
    reflib.fail(f"4 first requests: {resolutions()} resolutions, {len(registered)} log lines, |dlogprob| {worst}")
print(f"ok  4 first requests for an unregistered adapter registered it once and ran on it (|dlogprob| {worst:.1e})")

before = resolutions()
bodies = {}
for name in ("..", ".hidden", "escape", "junk", "wide", "nope", "a/../acme-b", "acme-b/..", "\\acme"):
    st, out, _ = req("POST", "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 2})
    if st != 404:
        reflib.fail(f"model {name!r}: {st} {out}")
    bodies[name] = json.dumps(out).replace(json.dumps(name)[1:-1], "NAME")
if len(set(bodies.values())) != 1:
    reflib.fail(f"the refusals differ: {bodies}")
# the server wrote each line before it answered: the wait is for this process's reader of its stderr
for name, words in (("escape", "outside"), ("junk", "'junk' is refused"), ("wide", "'wide' is refused")):
    wait_for(lambda: any(name in ln and words in ln for ln in srv.lines), 30,
             f"the log to say why {name} was refused ({words})")
st, out, _ = req("POST", "/v1/completions", {"model": "acme-b", "prompt": PROMPT, "max_tokens": 2})
if st != 200 or resolutions()[0] != before[0] + 1:
    reflib.fail(f"acme-b after the refusals: {st} {out} {resolutions()}")
print(f"ok  {len(bodies)} names that are not adapters here got the same 404; the operator's log says why")

# 3. keys
same_as_missing = [
    ("POST", "/v1/completions", lambda n: {"model": n, "prompt": PROMPT, "max_tokens": 2}),
    ("POST", "/v1/chat/completions", lambda n: {"model": n, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", lambda n: {"model": n, "prompt": "hello"}),
    ("POST", "/v1/rollout", lambda n: {"adapter": n, "groups": [{"input_ids": PROMPT}], "sampling": {"max_tokens": 2}}),
    ("POST", "/generate", lambda n: {"input_ids": PROMPT, "lora_path": n, "sampling_params": {"max_new_tokens": 2}}),
    ("GET", "/v1/models/{}", None), ("GET", "/v1/adapters/{}/stats", None),
    ("DELETE", "/v1/adapters/{}/versions/1", None), ("PUT", "/v1/adapters/{}/versions/2", lambda n: {"path": res_dir})]
st, _, _ = req("POST", "/v1/completions", {"model": "globex-x", "prompt": PROMPT, "max_tokens": 2}, GLOBEX)
if st != 200:
    reflib.fail(f"globex's own adapter: {st}")
n0 = resolutions()
for method, path, body in same_as_missing:
    seen = []
    for name in ("globex-x", "globex-nope"):
        st, out, _ = req(method, path.format(name), body(name) if body else None, ACME)
        seen.append((st, json.dumps(out).replace(name, "NAME")))
    if seen[0] != seen[1] or seen[0][0] not in (403, 404):
        reflib.fail(f"{method} {path} with another tenant's adapter and a missing one: {seen}")
st, out, _ = req("POST", "/v1/completions", {"model": "globex-other", "prompt": PROMPT, "max_tokens": 2}, ACME)
if resolutions() != n0:
    reflib.fail(f"a tenant's request for names outside its grant touched the disk: {n0} -> {resolutions()}")
st, out, _ = req("GET", "/v1/models", key=ACME)
listed = [m["id"] for m in out["data"]]
st2, out2, _ = req("GET", "/v1/adapters", key=ACME)
if listed != ["acme-a", "acme-b"] or sorted(a["name"] for a in out2) != ["acme-a", "acme-b"]:
    reflib.fail(f"acme lists {listed} and {[a['name'] for a in out2]}")
st, out, _ = req("POST", "/v1/completions", {"model": "base", "prompt": PROMPT, "max_tokens": 2}, ACME)
st2, out2, _ = req("POST", "/v1/completions", {"model": "base", "prompt": PROMPT, "max_tokens": 2}, GLOBEX)
if st != 404 or st2 != 200:
    reflib.fail(f"the base model: acme (no base) {st}, globex (base) {st2}")
with open(os.path.join(res_dir, "acme-b", "adapter_model.safetensors"), "rb") as f:
    raw = f.read()


def push_raw(name, key, version=2):
    return srv.request("PUT", f"/v1/adapters/{name}/versions/{version}?r=8&lora_alpha=16", raw=raw,
                       headers={**h(key), "Content-Type": "application/octet-stream"})


st, out, _ = push_raw("acme-a", ACME)
st2, out2, _ = push_raw("globex-x", GLOBEX)
if st != 200 or st2 != 403 or "push" not in out2["error"]["message"]:
    reflib.fail(f"pushing: acme (push) {st} {out}; globex (no push) {st2} {out2}")
st, out, _ = rollout("acme-a", ACME)
if st != 200 or out["groups"][0]["samples"][0]["adapter_version"] != 2:
    reflib.fail(f"acme's pushed version: {st} {out}")
# a tenant pushes files, not paths on the server (another tenant's adapter is one)
st, out, _ = req("PUT", "/v1/adapters/acme-steal/versions/1", {"path": os.path.join(res_dir, "globex-x")}, ACME)
if st != 403 or "not as a path" not in out["error"]["message"]:
    reflib.fail(f"a tenant's PUT by path: {st} {out}")
st, out, _ = push_raw("acme-up", ACME, version=1)
if st != 200:
    reflib.fail(f"a tenant's raw upload: {st} {out}")
st, out, _ = req("GET", "/v1/models", key=ACME)
st2, out2, _ = req("GET", "/v1/adapters", key=ACME)
roots = {m["id"]: m["root"] for m in out["data"]}
if any(r != i for i, r in roots.items()) or any(a["path"] for a in out2):
    reflib.fail(f"a tenant sees the server's paths: {roots} {[a['path'] for a in out2]}")

admin_routes = []
for m in re.finditer(r'\{"(/[^"]*)", "([A-Z ]+)", ([^,]+), (R_\w+)\}',
                     open(os.path.join(reflib.SRCDIR, "server", "routes.c")).read()):
    path, methods, flags = m.group(1), m.group(2).split(), m.group(3)
    if ("API" in flags or "ROUTE_AUTH" in flags) and "| T" not in flags:
        admin_routes += [(meth, path + ("/x" if "ROUTE_PREFIX" in flags else "")) for meth in methods]
if len(admin_routes) < 30:
    reflib.fail(f"read only {len(admin_routes)} admin routes from server/routes.c")
for meth, path in admin_routes:
    st, out, _ = req(meth, path, {} if meth in ("POST", "PUT") else None, ACME)
    if st != 403 or "admin" not in out["error"]["message"]:
        reflib.fail(f"a tenant's {meth} {path}: {st} {out}")
for hd in ({}, h("sk-wrong-000"), {"Authorization": "sk-acme-00001"}):
    st, out, _ = srv.request("GET", "/v1/models", headers=hd)
    if st != 401:
        reflib.fail(f"/v1/models with {hd}: {st}")
# /metrics names every tenant's busy adapters: an admin's, once some key is a tenant's
seen = [srv.request("GET", "/metrics", headers=hd)[0] for hd in ({}, h(ACME), h(ADMIN))]
if seen != [401, 403, 200]:
    reflib.fail(f"/metrics without a key, a tenant's, an admin's: {seen}")
for path in ("/v1/models/../../v1/state", "/v1/models/%2E%2E/x", "/x/../pause", "/v1/./state"):
    st, out, _ = srv.request("GET", path, headers=h(ACME))
    if st != 400 or "segment" not in out["error"]["message"]:
        reflib.fail(f"GET {path}: {st} {out}")
print(f"ok  keys: {len(same_as_missing)} routes answer another tenant's adapter as a missing one; "
      f"{len(admin_routes)} admin routes are 403 for a tenant; no key or a wrong one 401")

# 4. SIGHUP
th, res = srv.hold_call(lambda: rollout("acme-a", ACME, max_tokens=200), "a long rollout on acme's key")
write_keys(ACME2)
n_lines = len(srv.lines)
srv.proc.send_signal(signal.SIGHUP)
wait_for(lambda: any("SIGHUP: 3 keys" in ln for ln in srv.lines[n_lines:]), 30, "the keys reread")
st, _, _ = req("GET", "/v1/models", key=ACME)
st2, _, _ = req("GET", "/v1/models", key=ACME2)
srv.resume()
th.join()
held_st, held, _ = res[0]
if st != 401 or st2 != 200 or held_st != 200 or len(held["groups"][0]["samples"][0]["output_ids"]) != 200:
    reflib.fail(f"after SIGHUP: old key {st}, new key {st2}, the held rollout {held_st}")
with open(keys_file, "w") as f:
    f.write('{"keys": [{"key": "sk-long-enough", "role": "root"}]}')
n_lines = len(srv.lines)
srv.proc.send_signal(signal.SIGHUP)
wait_for(lambda: any("keys stay as they were" in ln for ln in srv.lines[n_lines:]), 30, "the bad file refused")
why = [ln for ln in srv.lines[n_lines:] if "keys stay" in ln][0]
st, _, _ = req("GET", "/v1/models", key=ACME2)
if st != 200 or "role" not in why or keys_file not in why:
    reflib.fail(f"a malformed key file: new key {st}; the log: {why}")
write_keys(ACME2)
print("ok  SIGHUP: a running rollout finished on its dropped key; new keys took effect; a bad file kept them: "
      + why.split("as they were: ")[-1].strip())

# 5. the router
rt = Server(["--replica", srv.base, "--api-keys", keys_file, "--api-key", ADMIN], command="router")
wait_for(lambda: rt.request("GET", "/health")[0] == 200, 30, "the router's /health")
st, out, _ = rt.request("GET", "/v1/models", headers=h(ACME2))
st2, out2, _ = rt.request("POST", "/v1/pause", {}, headers=h(ACME2))
st3, _, _ = rt.request("GET", "/v1/models", headers=h("sk-wrong-000"))
if (st != 200 or [m["id"] for m in out["data"]] != ["acme-a", "acme-b", "acme-up"] or st2 != 403
        or st3 != 401):
    reflib.fail(f"through the router: models {st} {out}; pause {st2} {out2}; wrong key {st3}")
for path in ("/x/../pause", "/v1/models/..%2F..%2Fpause", "/v1/models/%2E%2E/%2E%2E/v1/state"):
    for hd in ({}, h(ACME2)):
        st, out, _ = rt.request("POST", path, {}, headers=hd)
        if st != 400:
            reflib.fail(f"through the router, POST {path} with {hd}: {st} {out}")
st, out, _ = rt.request("GET", "/v1/adapters/acme-a/stats", headers=h(ACME2))
if st != 200 or out["requests"] < 1:
    reflib.fail(f"an adapter's stats through the router: {st} {out}")
if rt.stop() != 0:
    reflib.fail("the router did not exit 0 (under ASan: a leak?)\n" + "".join(rt.lines[-40:]))
print("ok  the router applies the key file and passes each request's own key on")

# 6. bounded metrics
names = [f"t{i:04d}" for i in range(N_MANY)]
for k in range(0, N_MANY, 100):  # 100 groups (adapters) per rollout
    st, out, _ = rollout(None, ACME2, max_tokens=2,
                         groups=[{"input_ids": PROMPT, "adapter": n} for n in names[k:k + 100]])
    if st != 200:
        reflib.fail(f"rollout over t{k:04d}..: {st} {out}")


def check_metrics(what):
    txt, vals = srv.metrics()
    labels = {}
    for key in vals:
        m = re.match(r'(\w+)\{.*adapter="([^"]*)"', key)
        if m:
            labels.setdefault(m.group(1), set()).add(m.group(2))
    worst_family = max(labels.items(), key=lambda kv: len(kv[1]))
    if len(worst_family[1]) > BOUND + 2:
        reflib.fail(f"{what}: {worst_family[0]} has {len(worst_family[1])} adapter labels (bound {BOUND} + base + _other)")
    if shutil.which("promtool"):
        p = subprocess.run(["promtool", "check", "metrics"], input=txt, capture_output=True, text=True)
        if p.returncode != 0 or p.stdout.strip() or p.stderr.strip():
            reflib.fail(f"{what}: promtool check metrics: {p.stdout}{p.stderr}")
    else:
        print(f"SKIP promtool check metrics ({what}): promtool is not installed")
    stats = {}
    for n in names + ["acme-a", "acme-b", "acme-up", "globex-x", "base"]:
        st, out, _ = req("GET", f"/v1/adapters/{n}/stats")
        if st != 200:
            reflib.fail(f"GET /v1/adapters/{n}/stats: {st} {out}")
        stats[n] = out

    def total(prefix):
        return sum(v for k, v in vals.items() if k.startswith(prefix + "{") or k == prefix)
    pairs = [("caraserve_request_success_total", "requests"), ("caraserve_generation_tokens_total", "generation_tokens"),
             ("caraserve_prompt_tokens_total", "prompt_tokens")]
    for fam, field in pairs:
        if total(fam) != sum(s[field] for s in stats.values()):
            reflib.fail(f"{what}: {fam} {total(fam)} != the sum of the stats' {field} "
                        f"{sum(s[field] for s in stats.values())}")
    if total("caraserve_adapter_time_to_first_token_seconds_count") != sum(s["latency"]["ttft_count"] for s in stats.values()):
        reflib.fail(f"{what}: TTFT counts differ")
    return vals, stats, max(len(v) for v in labels.values())


vals, stats, n_labels = check_metrics("1,000 adapters in use")
outsider = next(n for n in names if not stats[n]["own_series"])
for _ in range(3):
    rollout(outsider, ACME2, max_tokens=2)
vals2, stats2, _ = check_metrics("after an adapter outside the set got busier")
if not stats2[outsider]["own_series"] or vals2.get("caraserve_metrics_adapter_folds_total", 0) < 1:
    reflib.fail(f"{outsider} (3 more requests) did not take a place: {stats2[outsider]}, "
                f"folds {vals2.get('caraserve_metrics_adapter_folds_total')}")
print(f"ok  /metrics with {N_MANY} adapters in use: at most {n_labels} adapter labels per family, totals equal the "
      f"sum of {len(stats)} stats views; a busier adapter took a place at the next scrape")
if srv.stop() != 0:
    reflib.fail("the server did not exit 0 (under ASan: a leak?)\n" + "".join(srv.lines[-60:]))
print("PASS")
