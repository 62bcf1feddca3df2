#!/usr/bin/env python3
"""test_router.py: `caraserve router` in front of three `caraserve serve` replicas on
loopback. What it must do, each created as a state rather than waited for by luck:
  - pass the OpenAI routes through unchanged: the same completion (greedy) through the router
    as straight from a replica, non-streaming and streaming (the official openai client), the
    stream's pieces joining to the whole; the replica that answered named in a header;
  - send admin requests (an adapter load, pause, resume) to every replica;
  - place requests by its policy: round-robin in turn; least-loaded by what it has open on
    each replica (replicas paused, so requests stay open); rank-aware away from a paused
    replica whose queue is long (its /v1/state says so);
  - propagate a client's hang-up: a stream cut after its first token aborts the replica's
    request;
  - lose nothing that was not sent to a dead replica: one request held on each paused
    replica, one replica killed: its request fails with a clean 502, the other two finish,
    and every request sent afterwards is answered by the living;
  - /health: 200 while a replica lives, 503 when none does; bad flags refused.
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_router.py"""
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402
from serverlib import Server, tokenizer_dir, wait_for  # noqa: E402

root = reflib.tmpdir("cs_router_")
model = os.path.join(root, "model")
subprocess.run([reflib.MKMODEL, "model", "--out", model, "--arch", "llama", "--hidden", "64", "--layers", "2",
                "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--tokenizer", tokenizer_dir("spm-32k"),
                "--dtype", "bf16", "--seed", "5"], check=True, capture_output=True)
lora_root = os.path.join(root, "loras")
os.makedirs(lora_root)
for name, rank in (("r8", 8), ("r64", 64), ("late", 16)):
    subprocess.run([reflib.MKMODEL, "adapter", "--model", model, "--out", os.path.join(lora_root, name), "--rank",
                    str(rank), "--alpha", str(2 * rank), "--seed", str(rank), "--dtype", "bf16"], check=True,
                   capture_output=True)

# bad flags first (no replica needed)
for args, want in ((["--replica", "ftp://x"], "bad --replica"), ([], "at least one --replica"),
                   (["--replica", "http://127.0.0.1:1", "--policy", "fastest"], "bad --policy"),
                   (["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:1/"], "given twice"),
                   (["--replica", "http://127.0.0.1:1", "--poll-interval-ms", "0"], "bad --poll-interval-ms")):
    p = subprocess.run([reflib.CARASERVE, "router", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 2 or want not in p.stderr:
        reflib.fail(f"router {args}: exit {p.returncode}, want 2 and '{want}'\n{p.stderr}")
print("ok  bad router flags are refused (exit 2, with the reason)")

reps = [Server(["--model", model, "--served-model-name", "base", "--threads", "1", "--kv-cache-bytes", "8M",
                "--lora-modules", f"r8={lora_root}/r8", f"r64={lora_root}/r64", "--lora-root", lora_root,
                "--profile-cost-model", "0.3"]) for _ in range(3)]
urls = [r.base for r in reps]


def router(policy, poll_ms=20):
    rt = Server(["--policy", policy, "--poll-interval-ms", str(poll_ms), *sum((["--replica", u] for u in urls), [])],
                command="router")
    wait_for(lambda: all(x["healthy"] for x in state(rt)["replicas"]), 60, f"{policy} router: every replica in")
    return rt


def state(rt):
    st, body, _ = rt.request("GET", "/v1/state")
    if st != 200:
        reflib.fail(f"router /v1/state: {st} {body}")
    return body


def complete(srv, body, timeout=300):
    st, out, hd = srv.request("POST", "/v1/completions", body, timeout=timeout)
    return st, out, hd.get("X-Caraserve-Replica")


rr = router("round-robin")
st, hv, _ = rr.request("GET", "/health")
if st != 200:
    reflib.fail(f"router /health with 3 replicas: {st} {hv}")

# --- the same answers as a replica's own ---
body = {"model": "r64", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
st, direct, _ = complete(reps[0], body)
st2, via, who = complete(rr, body)
if st != 200 or st2 != 200 or via["choices"][0]["text"] != direct["choices"][0]["text"] or who not in urls:
    reflib.fail(f"through the router: {st2} {via} (replica {who}), straight: {st} {direct}")
if via["usage"] != direct["usage"]:
    reflib.fail(f"usage through the router {via['usage']} != {direct['usage']}")
import openai  # noqa: E402
cl = openai.OpenAI(base_url=rr.base + "/v1", api_key="none")
whole = cl.completions.create(model="r8", prompt="Once upon a time", max_tokens=10, temperature=0)
pieces = [c.choices[0].text for c in cl.completions.create(model="r8", prompt="Once upon a time", max_tokens=10,
                                                           temperature=0, stream=True) if c.choices]
if "".join(pieces) != whole.choices[0].text or len(pieces) < 2:
    reflib.fail(f"openai client through the router: stream {pieces} vs {whole.choices[0].text!r}")
chat = cl.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  temperature=0) if False else None  # spm-32k has no chat template
st, bad, _ = rr.request("POST", "/v1/completions", {"model": "r8", "prompt": "x", "max_tokens": -5})
if st != 400 or "max_tokens" not in json.dumps(bad):
    reflib.fail(f"a replica's 400 must come through unchanged: {st} {bad}")
st, nf, _ = rr.request("GET", "/v1/nothing-here")
if st != 404:
    reflib.fail(f"an unknown path through the router: {st} {nf}")
print(f"ok  completions pass through unchanged (non-streaming, and {len(pieces)} streamed pieces via openai), "
      f"errors too")

# a request whose length is ambiguous (two Content-Lengths, a request smuggled after the body)
# is refused by the router itself and its connection closed: nothing after it runs
smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
got = rr.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 0\r\n"
             b"Content-Length: %d\r\n\r\n" % len(smuggled) + smuggled, "router: two Content-Lengths")
if not got.startswith(b"HTTP/1.1 400 ") or got.count(b"HTTP/1.1 ") != 1 or b"Content-Length" not in got:
    reflib.fail(f"router: two Content-Lengths must get one 400 and a closed connection: {got[:600]!r}")
print("ok  the router refuses a request with two Content-Lengths (400) and closes the connection")

# --- admin requests reach every replica ---
st, out, _ = rr.request("POST", "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": f"{lora_root}/late"})
if st != 200:
    reflib.fail(f"load through the router: {st} {out}")
for r in reps:
    st, models, _ = r.request("GET", "/v1/models")
    if "late" not in [m["id"] for m in models["data"]]:
        reflib.fail(f"replica {r.base} did not get the adapter loaded through the router: {models}")
print("ok  an adapter load through the router reaches all 3 replicas")

# --- round-robin: in turn ---
seen = [complete(rr, dict(body, max_tokens=1))[2] for _ in range(6)]
if sorted(seen) != sorted(urls * 2) or seen[:3] == seen[3:6] and len(set(seen[:3])) != 3:
    reflib.fail(f"round-robin over 3 replicas sent 6 requests to {seen}")
print("ok  round-robin: 6 requests, 2 to each replica in turn")


def send_async(srv, b, results, key, stream=False):
    def go():
        try:
            results[key] = complete(srv, b, timeout=600)
        except Exception as e:  # noqa: BLE001
            results[key] = (None, repr(e), None)
    t = threading.Thread(target=go)
    t.start()
    return t


def waiting_on(rt, i):
    return state(rt)["replicas"][i]["requests"]


# --- least-loaded: by requests open through the router (replicas paused: they stay open) ---
for r in reps:
    r.pause("keep")
ll = router("least-loaded")
res, ths = {}, []
for k in range(6):
    ths.append(send_async(ll, dict(body, max_tokens=2), res, k))
    wait_for(lambda: sum(x["in_flight"] for x in state(ll)["replicas"]) == k + 1, 60, f"request {k} open")
loads = [x["in_flight"] for x in state(ll)["replicas"]]
if loads != [2, 2, 2]:
    reflib.fail(f"least-loaded: 6 held requests open as {loads}, want [2, 2, 2]")
for r in reps:
    r.resume()
for t in ths:
    t.join()
if any(res[k][0] != 200 for k in res):
    reflib.fail(f"least-loaded: {res}")
print("ok  least-loaded: 6 requests held on paused replicas spread 2/2/2, all answered after resume")

# --- rank-aware: away from the replica with a long queue ---
ra = router("rank-aware")
reps[0].pause("keep")
held, hth = {}, []
for k in range(4):  # straight to replica 0: its own queue, seen only through its /v1/state
    hth.append(send_async(reps[0], {"model": "r64", "prompt": "a b c d e f g h " * 8, "max_tokens": 16,
                                    "temperature": 0}, held, k))
wait_for(lambda: state(ra)["replicas"][0]["waiting"] >= 4, 60, "replica 0's queue in the router's view")
if not state(ra)["replicas"][0]["paused"] or any(x["paused"] for x in state(ra)["replicas"][1:]):
    reflib.fail(f"the router's view of which replicas are paused: {state(ra)}")
placed = [complete(ra, dict(body, max_tokens=2))[2] for _ in range(4)]
if urls[0] in placed:
    reflib.fail(f"rank-aware sent a request to the paused replica with 4 queued: {placed}")
reps[0].resume()
for t in hth:
    t.join()
print(f"ok  rank-aware: with replica 0 paused and 4 requests queued there, 4 new ones went to {sorted(set(placed))}"
      f" (how a queue prices a replica is unit-tested in test_sched)")

# --- a client's hang-up reaches the replica ---
for r in reps:
    r.settle()
aborts0 = sum(v for r in reps for k, v in r.metrics()[1].items()
              if k.startswith("caraserve_request_success_total") and 'finished_reason="abort"' in k)
c = http.client.HTTPConnection("127.0.0.1", rr.port, timeout=120)
c.request("POST", "/v1/completions", json.dumps({"model": "r8", "prompt": "hang up", "max_tokens": 1000,
                                                 "ignore_eos": True, "stream": True}),
          {"Content-Type": "application/json"})
resp = c.getresponse()
if resp.status != 200:
    reflib.fail(f"a long stream through the router: {resp.status} {resp.read()!r}")
first = resp.readline()
if not first.startswith(b"data: "):
    reflib.fail(f"stream through the router began with {first!r}")
c.sock.shutdown(2)
c.close()
wait_for(lambda: sum(v for r in reps for k, v in r.metrics()[1].items()
                     if k.startswith("caraserve_request_success_total") and 'finished_reason="abort"' in k)
         > aborts0, 60, "the replica to abort the request whose client hung up on the router")
for r in reps:
    r.settle()
print("ok  a client hanging up on a stream through the router aborts the request on its replica")

# --- the rollout side through the router ---
ro = {"batch_id": "b1", "adapter": "r64", "sampling": {"max_tokens": 6, "temperature": 0,
                                                       "logprobs": {"mode": "raw"}},
      "groups": [{"group_id": "g0", "input_ids": [5, 17, 300, 42], "n": 2, "seed": 7},
                 {"group_id": "g1", "input_ids": [9, 8, 7], "n": 1, "seed": 3}]}
st, want, _ = reps[0].request("POST", "/v1/rollout", ro)
st2, got, hd = rr.request("POST", "/v1/rollout", ro)


def samples(res):
    return {(g["group_id"], x["index"]): (x["output_ids"], x["logprobs"]) for g in res["groups"] for x in g["samples"]}


if st != 200 or st2 != 200 or samples(got) != samples(want):
    reflib.fail(f"/v1/rollout through the router: {st2} {got}\nstraight: {st} {want}")
c = http.client.HTTPConnection("127.0.0.1", rr.port, timeout=120)
c.request("POST", "/v1/rollout", json.dumps(dict(ro, stream=True)), {"Content-Type": "application/json"})
resp = c.getresponse()
lines = [json.loads(x) for x in resp.read().splitlines() if x.strip()]
c.close()
if resp.status != 200 or not resp.getheader("Content-Type", "").startswith("application/x-ndjson") or \
        "summary" not in lines[-1] or samples({"groups": lines[:-1]}) != samples(want):
    reflib.fail(f"streamed /v1/rollout through the router: {resp.status} {resp.getheader('Content-Type')} {lines}")
# a trainer's weight push: raw safetensors, the PEFT config in the query string, to every replica
weights = open(os.path.join(lora_root, "r8", "adapter_model.safetensors"), "rb").read()
st, out, _ = rr.request("PUT", "/v1/adapters/policy/versions/3?lora_alpha=16", raw=weights,
                        headers={"Content-Type": "application/octet-stream"})
if st != 200 or out.get("version") != 3:
    reflib.fail(f"PUT /v1/adapters/policy/versions/3 through the router: {st} {out}")
for r in reps:
    st, ads, _ = r.request("GET", "/v1/adapters")
    pol = [a for a in (ads if isinstance(ads, list) else ads.get("data", ads.get("adapters", []))) if a["name"] == "policy"]
    if not pol or pol[0]["active_version"] != 3:
        reflib.fail(f"replica {r.base} after the push through the router: {ads}")
# pause and resume reach every replica
st, out, _ = rr.request("POST", "/v1/pause", {"mode": "keep"})
if st != 200 or not all(r.request("GET", "/v1/state")[1]["paused"] for r in reps):
    reflib.fail(f"/v1/pause through the router: {st} {out}, {[r.request('GET', '/v1/state')[1]['paused'] for r in reps]}")
st, out, _ = rr.request("POST", "/v1/resume", {})
if st != 200 or any(r.request("GET", "/v1/state")[1]["paused"] for r in reps):
    reflib.fail(f"/v1/resume through the router: {st} {out}")
# and so do vLLM's and SGLang's names (no body, or SGLang's), and the prefix-cache flushes
for path, pbody, want_paused in (("/pause?mode=keep", None, True), ("/resume", None, False),
                                 ("/pause_generation", {"mode": "in_place"}, True), ("/continue_generation", {}, False),
                                 ("/flush_cache", None, False), ("/reset_prefix_cache", None, False)):
    st, out, _ = rr.request("POST", path, pbody)
    seen = [r.request("GET", "/is_paused")[1]["is_paused"] for r in reps]
    if st != 200 or seen != [want_paused] * len(reps):
        reflib.fail(f"{path} through the router: {st} {out}, replicas paused: {seen}")
print(f"ok  rollout side through the router: /v1/rollout equal to a replica's (and as {len(lines) - 1} NDJSON "
      f"groups + summary), a versioned weight push, pause/resume (ours, vLLM's, SGLang's) and cache flushes reach all 3 replicas")

# --- a replica dies: what was on it fails cleanly, nothing else is lost ---
slow = router("round-robin", poll_ms=600000)  # polls once: it learns of the death by trying
for r in reps:
    r.pause("keep")
# a replica seen unpaused beside paused ones would be preferred: wait for the router to see all
wait_for(lambda: all(x["paused"] for x in state(rr)["replicas"]), 60, "the router to see every replica paused")
res, ths, where = {}, [], {}
for k in range(3):  # round-robin: one held on each replica; which one, from the router's state
    before = [x["in_flight"] for x in state(rr)["replicas"]]
    ths.append(send_async(rr, dict(body, max_tokens=3), res, k))
    wait_for(lambda: sum(x["in_flight"] for x in state(rr)["replicas"]) == k + 1, 60, f"request {k} open")
    now = [x["in_flight"] for x in state(rr)["replicas"]]
    where[[i for i in range(3) if now[i] > before[i]][0]] = k
if sorted(where) != [0, 1, 2]:
    reflib.fail(f"round-robin held 3 requests as {where}")
# the router counts a request open before its bytes are on the wire: wait until each replica
# has its request queued (a request killed before it was sent would go elsewhere instead)
wait_for(lambda: all(len(r.request("GET", "/v1/state")[1]["waiting"]) == 1 for r in reps), 60,
         "each paused replica to hold its request")
reps[1].kill()
dead = where[1]
ths[dead].join()
if res[dead][0] != 502 or "failed" not in json.dumps(res[dead][1]):
    reflib.fail(f"the request on the killed replica: {res[dead]}")
reps[0].resume()
reps[2].resume()
for t in ths:
    t.join()
if res[where[0]][0] != 200 or res[where[2]][0] != 200:
    reflib.fail(f"the requests on the living replicas: {res}")
after = [complete(rr, dict(body, max_tokens=1)) for _ in range(6)]
if any(a[0] != 200 or a[2] == urls[1] for a in after):
    reflib.fail(f"after the kill: {after}")
wait_for(lambda: not state(rr)["replicas"][1]["healthy"], 60, "the router to take the dead replica out")
if not state(slow)["replicas"][1]["healthy"]:
    reflib.fail("the router that polls once already knows the replica is dead")
after = [complete(slow, dict(body, max_tokens=1)) for _ in range(6)]
_, ms = slow.metrics()
retried = sum(v for k, v in ms.items() if k.startswith("caraserve_router_retries_total"))
if any(a[0] != 200 or a[2] == urls[1] for a in after) or retried < 1 or state(slow)["replicas"][1]["healthy"]:
    reflib.fail(f"a router that had not noticed the death: {after}, {retried} retried, state {state(slow)}")
_, mv = rr.metrics()
print(f"ok  replica killed mid-run: its held request failed with 502, the 2 others finished, 6 more answered by "
      f"the living; a router that had not polled since sent 6 too, {int(retried)} retried after a refused connection")
if shutil.which("promtool"):
    p = subprocess.run(["promtool", "check", "metrics"], input=rr.metrics()[0], capture_output=True, text=True)
    if p.returncode != 0:
        reflib.fail(f"promtool on the router's /metrics: {p.stdout}{p.stderr}")
    print("ok  promtool check metrics on the router's /metrics")

for r in (reps[0], reps[2]):
    r.kill()
wait_for(lambda: rr.request("GET", "/health")[0] == 503, 60, "the router's /health to say 503 with no replica")
st, out, _ = complete(rr, dict(body, max_tokens=1))
if st not in (502, 503) or "error" not in out:
    reflib.fail(f"with every replica dead: {st} {out}")
for x in (rr, ll, ra, slow):
    if x.stop() != 0:
        reflib.fail("the router did not exit 0 on SIGTERM")
print("ok  no replica: /health 503 and a clean error; SIGTERM exits 0")
