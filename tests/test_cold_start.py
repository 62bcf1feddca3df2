#!/usr/bin/env python3
"""test_cold_start.py: the cold start (CaraServe's CPU-assisted prefill) on the strict test
device, no GPU needed. Adapter slots stream to the device a layer at a time; a request whose
slot is not complete runs the LoRA of the layers not there yet on the host workers
(lora/assist.c: the layer input goes out with get_signal, the term comes back with wait_add),
the layers that arrived on the device. CS_STRICT_LOCKSTEP=1 makes a slot advance one layer
per arrived-query, landed before the answer, so which forwards run which layers where follows
from the engine's own calls and not from thread timing.

The truth is the CPU backend, whose slots are complete at once (warm): every sample must have
the same tokens and logprobs within 1e-5 (the host sums in another order; measured ~1e-6).
  1. three adapters (F32 and BF16, ranks 4/8/16) and the base model in one mixed workload
     (prefix sharing, n=3 forks, chunked prefill): cold forwards with layers on both paths;
  2. --cold-start wait: nothing runs on the host, requests wait for their slots;
  3. one device slot (--max-loras 1): slots evicted while others stream in; then without
     lockstep, the copy thread streaming at 20 MB/s beside the compute (results asserted only);
     and the CUDA backend's cold-start code on the host CUDA emulator (results asserted);
  4. 50 cold adapters in a row (--sequential, two slots: every request finds its slot cold);
  5. an adapter file truncated after registration: only its requests fail, naming the file;
  6. `serve`: /metrics counts cold starts, host and device layers and transfer times
     (promtool-clean).
Run: CS_BUILDDIR=build CS_SRCDIR=. $PYTHON tests/test_cold_start.py"""
import json
import os
import random
import shutil
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402
import serverlib  # noqa: E402

import transformers  # noqa: E402
from hfmodels import make_adapters, make_model, mixed_workload, paired_lines, run_batch  # noqa: E402

transformers.utils.logging.disable_progress_bar()
TOL = 1e-5


def run(model_dir, requests, loras, strict, extra=(), env_extra=None):
    env = {"CS_TEST_DEVICE": "strict", "CS_STRICT_LOCKSTEP": "1"} if strict else {}
    env.update(env_extra or {})
    out, stats = run_batch(model_dir, requests, loras, extra, env, f"strict={strict}")
    return [json.loads(x) for x in out], stats


def compare(what, warm, cold, tol=TOL, rel=False, splits=None):
    """same tokens, logprobs within tol (rel: tol x (1 + |warm logprob|)); returns the largest
    difference (rel: the largest over 1 + |warm logprob|). splits (a list): a sample may part
    from warm's (a sampled or near-tied token that a perturbation flips); its logprobs are
    compared up to the token where they part, which is appended to splits"""
    worst = 0.0
    for a, b in paired_lines(what, warm, cold):
        if "samples" not in a or "samples" not in b:
            reflib.fail(f"{what}: request {a.get('id')} has no samples:\n  warm: {str(a)[:300]}\n  cold: {str(b)[:300]}")
        for sa, sb in zip(a["samples"], b["samples"]):
            if sa.get("error") or sb.get("error"):
                reflib.fail(f"{what}: request {a['id']} failed: {sa.get('error')} / {sb.get('error')}")
            upto = len(sa["tokens"])
            if sa["tokens"] != sb["tokens"]:
                if splits is None:
                    reflib.fail(f"{what}: request {a['id']} sample {sa['index']}: tokens {sa['tokens']} warm, "
                                f"{sb['tokens']} cold")
                upto = next(i for i, (p, q) in enumerate(zip(sa["tokens"] + [None], sb["tokens"] + [None])) if p != q)
                splits.append(upto)
            for x, y in list(zip(sa["logprobs"], sb["logprobs"]))[:upto]:
                worst = max(worst, abs(x - y) / (1 + abs(x) if rel else 1))
            for ta, tb in list(zip(sa.get("top_logprobs", []), sb.get("top_logprobs", [])))[:upto + 1]:
                for (ia, xa), (ib, xb) in zip(ta, tb):
                    if ia == ib:
                        worst = max(worst, abs(xa - xb) / (1 + abs(xa) if rel else 1))
    if worst > tol:
        reflib.fail(f"{what}: cold logprobs differ from warm ones by {worst:.3g}{' x (1 + |logprob|)' if rel else ''} "
                    f"(> {tol})")
    return worst


model_dir, ref = make_model("llama", dtype="float32", kv_heads=2, layers=8, seed=11)
loras = make_adapters(model_dir, ref, (4, 8, 16), seed=40, dtypes=("float32", "bfloat16", "float32"))
rng = random.Random(3)
reqs = mixed_workload(rng, [n for n, _ in loras])
warm, warm_stats = run(model_dir, reqs, loras, strict=False, extra=("--preload-adapters",))
if warm_stats.get("cold_start", {}).get("requests"):
    reflib.fail(f"the CPU backend had cold starts: {warm_stats['cold_start']}")

# 1. cpu-assist: layers on both paths, the same results
cold, st = run(model_dir, reqs, loras, strict=True, extra=("--preload-adapters", "--cold-start", "cpu-assist"))
worst = compare("cpu-assist", warm, cold)
cs = st["cold_start"]
if not (cs["requests"] >= 3 and cs["assisted"] == cs["requests"] and cs["waited"] == 0 and cs["host_layers"] > 0
        and cs["device_layers"] > 0 and 0 < cs["forwards"] < st["steps"] and cs["streams"] == 3):
    reflib.fail(f"cpu-assist: the cold start did not run on both paths: {cs} ({st['steps']} steps)")
if cs["pinned_allocs"] != 3:  # inputs, terms, flags: once each, at the start, for the largest batch
    reflib.fail(f"cpu-assist: {cs['pinned_allocs']} pinned buffers made, not 3 at the start")
print(f"ok  cpu-assist: {cs['requests']} cold requests, {cs['forwards']} of {st['steps']} forwards with a slot "
      f"streaming in ({cs['host_layers']} adapter layers on the host, {cs['device_layers']} on the device, "
      f"{cs['host_rows']} host rows); logprobs within {worst:.2g} of warm; 3 pinned buffers, made at the start")

# 1b. the terms sent back as BF16 (--assist-dtype bf16: half the bytes over the link): each
# term is the F32 one rounded to 8 significant bits (a relative error of at most 2^-9). The
# logprobs must stay within BF16's own resolution of them, 2^-8 x (1 + |logprob|) (measured:
# 2.8e-3 at most in absolute terms on these random rank 4-16 adapters, whose deltas are as
# large as the base's outputs), and differ from warm at all (else nothing was rounded)
TOL_BF16 = 2.0 ** -8
cold, st = run(model_dir, reqs, loras, strict=True,
               extra=("--preload-adapters", "--cold-start", "cpu-assist", "--assist-dtype", "bf16"))
parted = []
worst_bf16 = compare("cpu-assist, BF16 terms", warm, cold, TOL_BF16, rel=True, splits=parted)
n_samples = sum(len(x["samples"]) for x in warm)
if len(parted) > n_samples // 4:
    reflib.fail(f"cpu-assist, BF16 terms: {len(parted)} of {n_samples} samples parted from warm's tokens")
cs = st["cold_start"]
if not (cs["host_layers"] > 0 and cs["device_layers"] > 0):
    reflib.fail(f"cpu-assist, BF16 terms: the cold start did not run on both paths: {cs}")
if worst_bf16 <= 1e-6:
    reflib.fail(f"cpu-assist, BF16 terms: within {worst_bf16:.2g} of warm: the terms were not rounded")
print(f"ok  cpu-assist with BF16 terms: {cs['host_layers']} host layers; logprobs within {worst_bf16:.2g} x "
      f"(1 + |logprob|) of warm (<= 2^-8); {len(parted)} of {n_samples} samples parted from warm's tokens "
      f"(at {parted}), compared up to there")

# 2. wait: requests wait for their slots, nothing on the host
cold, st = run(model_dir, reqs, loras, strict=True, extra=("--preload-adapters", "--cold-start", "wait"))
worst = compare("wait", warm, cold)
cs = st["cold_start"]
if not (cs["waited"] >= 3 and cs["assisted"] == 0 and cs["host_layers"] == 0 and cs["forwards"] == 0
        and cs["assist_threads"] == 0):
    reflib.fail(f"wait: {cs}")
print(f"ok  wait: {cs['waited']} requests waited for their slots, none ran on the host; within {worst:.2g}")

# 2b. auto: the byte model chooses per request. cpu-assist sends each host layer's inputs out
# (q/k/v share one; o, gate/up, down: 64 + 64 + 64 + 96 floats a row here) and the terms back
# (64 + 32 + 32 + 64 + 96 + 96 + 64 floats); wait streams the rest of the slot (rank x
# (d_in + d_out) a module). Computed here from the model's shapes, not by caraserve's code:
# a request is assisted while its rows cost fewer bytes than its adapter, else it waits.
H, KVD, INTER = 64, 32, 96
DIMS = [(H, H), (H, KVD), (H, KVD), (H, H), (H, INTER), (H, INTER), (INTER, H)]


def prefer_assist(rank, adapter_bytes, rows, terms_bytes=4):
    wait = sum(rank * (a + b) * adapter_bytes for a, b in DIMS)
    assist = rows * (sum(b for _, b in DIMS) * terms_bytes + (H + H + H + INTER) * 4)
    return assist <= wait


auto_reqs, want_assist = [], 0
for i, (name, rank, abytes, n) in enumerate((("a0", 4, 4, 40), ("a1", 8, 2, 3), ("a2", 16, 4, 3), ("a2", 16, 4, 30))):
    auto_reqs.append({"id": i, "prompt_ids": [1] + [rng.randrange(3, 200) for _ in range(n - 1)], "max_tokens": 4,
                      "adapter": name, "temperature": 0, "logprobs": 2, "ignore_eos": True})
    want_assist += prefer_assist(rank, abytes, n)
warm_a, _ = run(model_dir, auto_reqs, loras, strict=False, extra=("--preload-adapters",))
cold, st = run(model_dir, auto_reqs, loras, strict=True,
               extra=("--preload-adapters", "--cold-start", "auto"))
worst = compare("auto", warm_a, cold)
cs = st["cold_start"]
if (cs["auto_assist"], cs["auto_wait"]) != (want_assist, len(auto_reqs) - want_assist) or cs["requests"] != len(auto_reqs):
    reflib.fail(f"auto: the byte model chose {cs['auto_assist']} cpu-assist and {cs['auto_wait']} wait of "
                f"{cs['requests']} cold requests; the shapes say {want_assist} and {len(auto_reqs) - want_assist}: {cs}")
if cs["assisted"] != want_assist or cs["waited"] != len(auto_reqs) - want_assist:
    reflib.fail(f"auto: {cs['assisted']} assisted and {cs['waited']} waited, not as chosen: {cs}")
print(f"ok  auto: of {len(auto_reqs)} cold requests (prompts of 40, 3, 3, 30 tokens; ranks 4, 8, 16, 16) the byte "
      f"model assisted {cs['auto_assist']} and made {cs['auto_wait']} wait, as the shapes say; within {worst:.2g}")

# 3. one device slot: slots are evicted while others stream in
cold, st = run(model_dir, reqs, loras, strict=True,
               extra=("--preload-adapters", "--cold-start", "cpu-assist", "--max-loras", "1"))
worst = compare("--max-loras 1", warm, cold)
cs = st["cold_start"]
if not (st["lora_device_evictions"] >= 2 and cs["host_layers"] > 0 and cs["device_layers"] > 0):
    reflib.fail(f"--max-loras 1: no evictions under streaming: evictions {st['lora_device_evictions']}, {cs}")
print(f"ok  one slot for three adapters: {st['lora_device_uploads']} slots streamed, {st['lora_device_evictions']} "
      f"evicted, {cs['host_layers']} host layers; within {worst:.2g}")

# 3b. without lockstep: the copy thread streams while the engine computes and the workers
# assist (which layers run where now depends on timing: only the results are asserted)
cold, st = run(model_dir, reqs, loras, strict=True, extra=("--preload-adapters", "--cold-start", "cpu-assist"),
               env_extra={"CS_STRICT_LOCKSTEP": "0", "CS_STRICT_GBPS": "0.02", "CS_STRICT_LATENCY_US": "200"})
worst = compare("free-running stream", warm, cold)
cs = st["cold_start"]
if cs["requests"] < 3 or cs["streams"] < 1:  # a slot may still be streaming when the last request ends
    reflib.fail(f"free-running stream: {cs}")
print(f"ok  free-running streams (20 MB/s link): {cs['forwards']} cold forwards, {cs['host_layers']} host and "
      f"{cs['device_layers']} device layers this time; within {worst:.2g}")

# 3c. the CUDA backend's own cold-start code on the host emulator (its loader thread, staging,
# host functions, the wait_add kernel), free-running: results asserted, the paths reported.
# Not under ThreadSanitizer, which cannot run the emulator's fibers (CS_COLD_SKIP_EMU=1).
if os.environ.get("CS_COLD_SKIP_EMU") != "1":
    cold, st = run(model_dir, reqs, loras, strict=False, extra=("--preload-adapters", "--cold-start", "cpu-assist"),
                   env_extra={"CS_TEST_DEVICE": "cuda-emu"})
    worst = compare("cuda-emu", warm, cold)
    cs = st["cold_start"]
    if st["backend"]["name"] != "cuda-emu" or cs["streams"] < 1 or cs["assist_threads"] < 1:
        reflib.fail(f"cuda-emu: slots did not stream through the CUDA backend: {st['backend']['name']}, {cs}")
    print(f"ok  cuda-emu: {cs['streams']} slots streamed by the CUDA backend's loader, {cs['forwards']} cold forwards "
          f"({cs['host_layers']} host, {cs['device_layers']} device layers this time); within {worst:.2g} of warm")
    cold, st = run(model_dir, reqs, loras, strict=False,
                   extra=("--preload-adapters", "--cold-start", "cpu-assist", "--assist-dtype", "bf16"),
                   env_extra={"CS_TEST_DEVICE": "cuda-emu"})
    parted = []
    worst = compare("cuda-emu, BF16 terms", warm, cold, TOL_BF16, rel=True, splits=parted)
    if len(parted) > n_samples // 4:
        reflib.fail(f"cuda-emu, BF16 terms: {len(parted)} of {n_samples} samples parted from warm's tokens")
    print(f"ok  cuda-emu with BF16 terms: {st['cold_start']['host_layers']} host layers; within {worst:.2g} x "
          f"(1 + |logprob|) of warm; {len(parted)} of {n_samples} samples parted (at {parted})")

# 4. fifty cold adapters in a row
many, reqs4 = [], []
for i in range(50):
    many.append((f"b{i}", loras[i % 3][1]))
    reqs4.append({"id": i, "prompt_ids": [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(10, 60))],
                  "max_tokens": 4, "logprobs": 2, "ignore_eos": True, "temperature": 0, "adapter": f"b{i}"})
warm4, _ = run(model_dir, reqs4, many, strict=False, extra=("--sequential",))
cold4, st = run(model_dir, reqs4, many, strict=True,
                extra=("--sequential", "--cold-start", "cpu-assist", "--max-loras", "2"))
worst = compare("50 adapters", warm4, cold4)
cs = st["cold_start"]
if cs["requests"] != 50 or cs["assisted"] != 50 or st["lora_device_uploads"] != 50 or cs["host_layers"] == 0:
    reflib.fail(f"50 adapters: not 50 cold starts: {cs}, {st['lora_device_uploads']} slots")
print(f"ok  50 cold adapters in a row: 50 cold starts, 50 slots streaming in ({st['lora_device_evictions']} evicted, "
      f"some before they were complete), {cs['host_layers']} host layers, {cs['device_layers']} device layers; "
      f"within {worst:.2g}")

# 5. a file truncated after registration: only its requests fail
bad = reflib.tmpdir("cs_cold_bad_")
for f in os.listdir(loras[0][1]):
    shutil.copy(os.path.join(loras[0][1], f), bad)
reqs5 = [dict(r) for r in reqs]
for r in reqs5:
    if r.get("adapter") == "a0":
        r["adapter"] = "broken"
broken_ids = {r["id"] for r in reqs5 if r.get("adapter") == "broken"}
st_path = os.path.join(bad, "adapter_model.safetensors")
# cut in half: its header still parses (registration probes only the header), its weights
# are short when the load reads them
size = os.path.getsize(st_path)
with open(st_path, "r+b") as f:
    f.truncate(size // 2)
out5, st = run(model_dir, reqs5, loras[1:] + [("broken", bad)], strict=True, extra=("--cold-start", "cpu-assist"))
for a, b in zip(warm, out5):
    if b["id"] in broken_ids:
        msg = b.get("error") or (b.get("samples") or [{}])[0].get("error") or ""
        if "broken" not in msg or "adapter_model.safetensors" not in msg:
            reflib.fail(f"truncated adapter: request {b['id']} should fail naming the adapter and file: {str(b)[:400]}")
compare("truncated neighbour", [w for w in warm if w["id"] not in broken_ids],
        [o for o in out5 if o["id"] not in broken_ids])
print(f"ok  a truncated adapter file: its {len(broken_ids)} requests fail naming it; the other "
      f"{len(out5) - len(broken_ids)} match the warm run")

# 5b. a cold adapter streaming in from disk (serve, 4 KiB chunks): its request starts once the
# file's header is read, and each layer's LoRA waits only for that layer's bytes. The test
# hold (CS_FAULT_HOLD_*) stops the adapter's reads after K chunks (its first layers complete,
# the rest not) until a gate file goes: the request is then running on a half-read adapter,
# a state the loader makes and this test only observes. Then the same with the file
# truncated while held: that request fails naming the file, the others go on.
def layer_chunks(path, chunk=4096):
    """the chunks [first, last] each layer's tensors take in a safetensors file"""
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(hlen))
    spans = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        b, e = t["data_offsets"]
        lo, hi = spans.get(layer, (1 << 62, 0))
        spans[layer] = (min(lo, 8 + hlen + b), max(hi, 8 + hlen + e))
    return [(spans[l][0] // chunk, (spans[l][1] - 1) // chunk) for l in sorted(spans)]


def held_copy(src, tag):
    d = reflib.tmpdir(f"cs_held_{tag}_")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), d)
    return d


prompt = [1] + list(range(7, 47))
want, _ = run(model_dir, [{"id": 0, "prompt_ids": prompt, "max_tokens": 6, "logprobs": 1, "ignore_eos": True,
                           "temperature": 0, "adapter": "a2"}], loras, strict=False, extra=("--preload-adapters",))


def held_run(device, device_env):
    held = held_copy(loras[2][1], "a")    # rank 16, F32: many chunks a layer
    held2 = held_copy(loras[2][1], "b")   # the one truncated while held
    held3 = held_copy(loras[2][1], "c")   # the one asked for while another request runs
    chunks = layer_chunks(os.path.join(held, "adapter_model.safetensors"))
    K = chunks[1][1] + 1                  # layers 0 and 1 in (8 layers: file order is layer order)
    done_layers = sum(1 for _, last in chunks if last < K)
    if not 1 <= done_layers < len(chunks):
        reflib.fail(f"held adapter: {K} chunks leave {done_layers} of {len(chunks)} layers in: pick another")
    gate = os.path.join(reflib.tmpdir("cs_gate_"), "gate")
    open(gate, "w").close()
    srv = serverlib.Server(["--model", model_dir, "--lora-modules", f"held={held}", f"held2={held2}",
                                f"held3={held3}", f"a1={loras[1][1]}",
                            "--threads", "2", "--kv-cache-bytes", "16M", "--cold-start", "cpu-assist"],
                           env={**device_env, "CS_FAULT_LOAD_CHUNK": "4096",
                                "CS_FAULT_HOLD_PATH": "/cs_held_", "CS_FAULT_HOLD_CHUNKS": str(K),
                                "CS_FAULT_HOLD_WHILE": gate})
    try:
        res = {}

        def ask(key, model):
            res[key] = srv.request("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6,
                                                               "logprobs": 1, "ignore_eos": True, "temperature": 0})
        t = threading.Thread(target=ask, args=("held", "held"))
        t.start()

        def started():
            _, v = srv.metrics()
            return v.get("caraserve_lora_partial_acquires_total", 0) >= 1
        serverlib.wait_for(started, timeout=60, what="the request to start on the half-read adapter")
        _, v = srv.metrics()
        if v.get('caraserve_lora_adapters{tier="loading"}') != 1 or v.get("caraserve_lora_streamed_loads_total") != 1:
            reflib.fail(f"held adapter: not loading while its request runs: {v}")
        if not t.is_alive():
            reflib.fail(f"held adapter: the request ended before its layers were read: {res.get('held')}")
        os.unlink(gate)                   # the disk goes on
        t.join(300)
        code, body, _ = res["held"]
        if code != 200:
            reflib.fail(f"held adapter: {code} {body}")
        got = body["choices"][0]["logprobs"]["token_logprobs"]
        ref_lp = want[0]["samples"][0]["logprobs"]
        diff = max(abs(x - y) for x, y in zip(got, ref_lp)) if len(got) == len(ref_lp) else float("inf")
        if diff > TOL:
            reflib.fail(f"held adapter: logprobs {got} vs warm {ref_lp} (max diff {diff:.3g})")
        _, v = srv.metrics()
        if v.get('caraserve_cold_start_layers_total{path="host"}', 0) < 1:
            reflib.fail(f"held adapter: no layer ran on the host: {v}")
        print(f"ok  {device}, streaming from disk: the request started with {done_layers} of {len(chunks)} layers read (reads held "
              f"after {K} of {chunks[-1][1] + 1} 4 KiB chunks), finished once the rest came; logprobs within "
              f"{diff:.2g} of warm")

        # asked for while another request runs: starting it would make that request wait for
        # the disk with it, so it waits for the whole file instead; the other one finishes
        # while the file is still held (and could not, were they in one batch)
        open(gate, "w").close()
        res.pop("held3", None)

        def start_long():
            th = threading.Thread(target=lambda: res.__setitem__("long", srv.request(
                "POST", "/v1/completions", {"model": "a1", "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                                            "temperature": 0})))
            th.start()
            return [th]
        long_threads = srv.hold_running(start_long, "a long request")
        t = threading.Thread(target=ask, args=("held3", "held3"))
        t.start()
        srv.resume()
        for th in long_threads:
            th.join(300)
        if res["long"][0] != 200 or not t.is_alive() or not os.path.exists(gate):
            reflib.fail(f"a half-read adapter beside a running request: the running one should finish first "
                        f"({res['long'][0]}), the other wait ({t.is_alive()})")
        os.unlink(gate)
        t.join(300)
        code, body, _ = res["held3"]
        got3 = body["choices"][0]["logprobs"]["token_logprobs"] if code == 200 else None
        if got3 is None or max(abs(x - y) for x, y in zip(got3, ref_lp)) > TOL or len(got3) != len(ref_lp):
            reflib.fail(f"held3: {code} {str(body)[:300]}")
        print(f"ok  {device}, a half-read adapter beside a running request: that one finished while the file was "
              f"held, the new one waited for the whole file, then matched warm")

        # the same, truncated while held
        open(gate, "w").close()
        n_partial = srv.metrics()[1].get("caraserve_lora_partial_acquires_total", 0)
        t = threading.Thread(target=ask, args=("held2", "held2"))
        t.start()

        def started2():
            _, v = srv.metrics()
            return v.get("caraserve_lora_partial_acquires_total", 0) > n_partial
        serverlib.wait_for(started2, timeout=60, what="the second request to start on its half-read adapter")
        with open(os.path.join(held2, "adapter_model.safetensors"), "r+b") as f:
            f.truncate((chunks[-1][0]) * 4096)    # inside the last layer
        os.unlink(gate)
        t.join(300)
        code, body, _ = res["held2"]
        if code == 200 or "held2" not in str(body) or "adapter_model.safetensors: read: unexpected end" not in str(body):
            reflib.fail(f"truncated while streaming: want an error naming the adapter and file, got {code} {str(body)[:400]}")
        for m in ("a1", "held"):
            ask(m, m)
            if res[m][0] != 200:
                reflib.fail(f"truncated while streaming: {m} after it: {res[m][0]} {str(res[m][1])[:300]}")
        print(f"ok  {device}, truncated while streaming: its request failed ({code}: {str(body)[:160]}); the other adapters serve on")
    finally:
        srv.stop()


held_run("strict", {"CS_TEST_DEVICE": "strict", "CS_STRICT_LOCKSTEP": "1"})
# the CUDA backend's feed (its loader thread queues a slot's layers as they are fed) on the
# host emulator, free-running (not under ThreadSanitizer: the emulator's fibers)
if os.environ.get("CS_COLD_SKIP_EMU") != "1":
    held_run("cuda-emu", {"CS_TEST_DEVICE": "cuda-emu"})

# 6. serve: the metrics
srv = serverlib.Server(["--model", model_dir, "--lora-modules", *[f"{n}={d}" for n, d in loras], "--threads", "2",
                        "--kv-cache-bytes", "16M", "--cold-start", "cpu-assist", "--max-num-batched-tokens", "16"],
                       env={"CS_TEST_DEVICE": "strict", "CS_STRICT_LOCKSTEP": "1"})
try:
    for name, _ in loras:
        code, body, _ = srv.request("POST", "/v1/completions", {"model": name, "prompt": [1] + list(range(5, 45)),
                                                                "max_tokens": 8, "temperature": 0})
        if code != 200:
            reflib.fail(f"serve: {name}: {code} {body}")
    # load and transfer times are reported from the loader thread (a load's after the adapter
    # is usable; a slot's once its last layer landed: the copy side never calls back itself):
    # they come, but may trail the last response
    names = [n for n, _ in loras]

    def adapter_loads(n):
        code, body, _ = srv.request("GET", f"/v1/adapters/{n}/stats")
        if code != 200:
            reflib.fail(f"serve: GET /v1/adapters/{n}/stats: {code} {body}")
        return body["loads"]

    def times_reported():
        return all(adapter_loads(n)["from_disk"] == 1 and adapter_loads(n)["to_device"] == 1 for n in names)
    serverlib.wait_for(times_reported, timeout=60, what="a load and a transfer time per adapter in /metrics")
    txt, vals = srv.metrics()
    need = {'caraserve_cold_starts_total{mode="cpu_assist"}': 3, 'caraserve_cold_start_layers_total{path="host"}': 1,
            'caraserve_cold_start_layers_total{path="device"}': 1}
    for k, v in need.items():
        if vals.get(k, 0) < v:
            reflib.fail(f"serve: /metrics {k} = {vals.get(k)} (want >= {v}):\n{txt}")
    for k in ('caraserve_lora_transfer_seconds_count', 'caraserve_lora_load_seconds_count'):
        if vals.get(k) != len(names):
            reflib.fail(f"serve: /metrics {k} = {vals.get(k)} (want {len(names)}, one per adapter)")
    if shutil.which("promtool"):
        p = subprocess.run(["promtool", "check", "metrics"], input=txt, capture_output=True, text=True)
        if p.returncode != 0 or p.stdout.strip() or p.stderr.strip():
            reflib.fail(f"promtool check metrics: exit {p.returncode}\n{p.stdout}{p.stderr}")
    print(f"ok  serve: /metrics counts {vals[list(need)[0]]:.0f} cold starts, "
          f"{vals[list(need)[1]]:.0f} host and {vals[list(need)[2]]:.0f} device layers, a transfer and a load "
          f"time per adapter{' (promtool clean)' if shutil.which('promtool') else ''}")
finally:
    srv.stop()
print("PASS")
