"""test_faults.py: what a client sees when things go wrong under `caraserve serve` (docs/errors.md's
reliability table names this test for these rows).

1. The disk answers an adapter's reads with EIO (CS_FAULT_EIO_PATH: the loader's fault
   injection, as the kernel reports a media error): requests for that adapter fail with 500
   and an error that names the file and the I/O error; the base model and a healthy adapter answer as
   before; /health stays 200. Once the disk heals, the same adapter serves again (a load the
   disk failed is tried again a second later), with the greedy tokens of a healthy copy.
   An adapter's files replaced on disk after registration are refused at the next load with
   a message saying they changed (never old and new weights mixed).
2. The KV cache is exhausted: one request with n=8 samples needs about three times the cache;
   every sample is preempted and recomputed as the cache allows (num_preemptions_total grows)
   and comes back whole, each equal to the same request run alone; a prompt longer than the
   whole cache is refused at once (400), not queued forever.
3. A client that reads its stream very slowly (it stops reading, its socket buffers full):
   another request completes meanwhile, and the slow client, once it reads, gets every token
   and the end of the stream: nothing is lost and nobody waits on it."""
import json
import os
import shutil
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from serverlib import Server, make_tok_model, wait_for  # noqa: E402

transformers.utils.logging.disable_progress_bar()

model_dir, ref, _ = make_tok_model("spm-32k", seed=11)
root = reflib.tmpdir("cs_faults_")
good_dir, _ = make_adapter(model_dir, ref, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=31)
sick_src, _ = make_adapter(model_dir, ref, r=8, alpha=16, targets=["q_proj", "v_proj", "o_proj"], seed=32)
sick_dir = os.path.join(root, "sick", "adapter")
copy_dir = os.path.join(root, "healthy-copy")
shutil.copytree(sick_src, sick_dir)
shutil.copytree(sick_src, copy_dir)
flag = os.path.join(root, "disk-failing")

# ---- 1. EIO ----
srv = Server(["--model", model_dir, "--served-model-name", "base", "--threads", "2", "--kv-cache-bytes", "32M",
              "--lora-modules", f"good={good_dir}", f"sick={sick_dir}", f"copy={copy_dir}", "--max-cpu-loras", "1",
              "--lora-root", root],
             env={"CS_FAULT_EIO_PATH": "/sick/", "CS_FAULT_EIO_WHILE": flag})


def complete(model, prompt="The quick brown fox", n_tok=8, server=None):
    return (server or srv).request("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n_tok,
                                                             "temperature": 0, "ignore_eos": True})


want = {m: complete(m)[1]["choices"][0]["text"] for m in ("base", "good", "copy")}
open(flag, "w").close()  # the disk fails from here
st, body, _ = complete("sick")
msg = json.dumps(body)
if st != 500 or "error" not in body or "sick/adapter/" not in msg or "Input/output error" not in msg:
    reflib.fail(f"a request on an adapter whose reads fail: {st} {msg[:400]}")
eio_status = st
for m in ("base", "good"):
    st2, b2, _ = complete(m)
    if st2 != 200 or b2["choices"][0]["text"] != want[m]:
        reflib.fail(f"{m} while another adapter's disk fails: {st2} {b2}")
if srv.request("GET", "/health")[0] != 200:
    reflib.fail("/health while an adapter's disk fails")
os.unlink(flag)  # healed
# a failed load is tried again by the first request a second after it failed (LORA_RETRY_MS):
# from then on the adapter serves; until then its requests fail at once
healed = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(complete("sick")), timeout=60,
                  what="the adapter serving again after the disk healed")
st, body, _ = healed
if body["choices"][0]["text"] != want["copy"]:
    reflib.fail(f"the adapter after the disk healed: {st} {body} (want {want['copy']!r})")
# an adapter's files replaced on disk after it was registered (a rank-16 adapter over the
# rank-8 one, each file by rename as a deploy would): the next load (the one-adapter host
# cache evicted it) reads the new files and serves their tokens, or refuses them with a
# message; never old and new mixed
new_src, _ = make_adapter(model_dir, ref, r=16, alpha=16, targets=["q_proj", "v_proj"], seed=33)
new_copy = os.path.join(root, "new-copy")
shutil.copytree(new_src, new_copy)
st, b, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": new_copy})
want["new"] = complete("new")[1]["choices"][0]["text"]
for fn in ("adapter_config.json", "adapter_model.safetensors"):
    shutil.copy(os.path.join(new_src, fn), os.path.join(root, fn + ".tmp"))
    os.replace(os.path.join(root, fn + ".tmp"), os.path.join(good_dir, fn))
complete("base")  # (evicts nothing: the base model needs no adapter)
st, body, _ = complete("good")
if st == 200:
    if body["choices"][0]["text"] != want["new"]:
        reflib.fail(f"an adapter replaced on disk served neither its new weights' tokens: {body} (new: {want['new']!r})")
    replaced = "served the new files' tokens"
elif "error" in body and "good" in json.dumps(body):
    replaced = f"refused with {st}: {body['error']['message'][:100]}"
else:
    reflib.fail(f"an adapter replaced on disk: {st} {body}")
if st != 200 and "changed" not in body["error"]["message"]:
    reflib.fail(f"an adapter replaced on disk: the refusal should say its files changed: {body}")
print(f"ok  an adapter's files replaced after registration: {replaced}")
print(f"ok  EIO reading an adapter: its request answered {eio_status} naming the file and the I/O error; base and "
      f"another adapter unaffected, /health 200; once healed the adapter serves the tokens of a healthy copy")
srv.stop()

# ---- 2. the KV cache exhausted ----
# 64 hidden, 2 layers, 2 KV heads of 16: 512 bytes a token; 256K holds about 512 tokens
srv = Server(["--model", model_dir, "--served-model-name", "base", "--threads", "2", "--kv-cache-bytes", "256K",
              "--batch-invariant", "--max-model-len", "1024"])
PROMPT = "Once upon a time"
alone = srv.request("POST", "/v1/completions", {"model": "base", "prompt": PROMPT, "max_tokens": 200,
                                                "temperature": 0, "ignore_eos": True})[1]["choices"][0]["text"]
pre0 = srv.metrics()[1].get("caraserve_num_preemptions_total", 0)
st, body, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": PROMPT, "max_tokens": 200, "n": 8,
                                                      "temperature": 0, "ignore_eos": True})
if st != 200 or len(body["choices"]) != 8:
    reflib.fail(f"n=8 beyond the KV cache: {st} {str(body)[:300]}")
for c in body["choices"]:
    if c["text"] != alone or c["finish_reason"] != "length":
        reflib.fail(f"sample {c['index']} after preemption differs from the request alone: {c}")
pre = srv.metrics()[1].get("caraserve_num_preemptions_total", 0) - pre0
if pre < 1:
    reflib.fail("8 samples of 200 tokens in a 512-token cache were never preempted: the test does not exhaust it")
if body["usage"]["completion_tokens"] != 1600:
    reflib.fail(f"usage after preemption: {body['usage']}")
st, body, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": "word " * 700, "max_tokens": 1})
if st != 400:
    reflib.fail(f"a prompt longer than the whole KV cache: {st} {body}")
print(f"ok  KV cache exhausted: 8 samples of 200 tokens in a ~512-token cache, {int(pre)} preemptions, every sample "
      f"equal to the request alone; a prompt beyond the whole cache: 400 ({body['error']['message'][:80]}...)")

srv.stop()

# ---- 3. a client that reads its stream very slowly ----
# 8 samples x 1000 tokens with 20 alternatives each: about 7 MB of events, more than the
# kernel buffers of a loopback connection hold (4 MB send, 4 KB receive here)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--threads", "2", "--kv-cache-bytes", "32M"])
N_SLOW, T_SLOW = 8, 1000
slow = socket.socket()
slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
slow.connect(("127.0.0.1", srv.port))
req = json.dumps({"model": "base", "prompt": PROMPT, "max_tokens": T_SLOW, "n": N_SLOW, "stream": True,
                  "ignore_eos": True, "temperature": 1.0, "seed": 1, "logprobs": 20}).encode()
slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
             b"Content-Length: "
             + str(len(req)).encode() + b"\r\n\r\n" + req)
got = slow.recv(1)  # its stream has begun (the status line's first byte); it reads nothing more for now
st, body, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": "Hello", "max_tokens": 20})
if st != 200 or body["usage"]["completion_tokens"] != 20:
    reflib.fail(f"a request while another client does not read its stream: {st} {body}")
slow.settimeout(120)
while True:
    chunk = slow.recv(65536)
    if not chunk:
        break
    got += chunk
    if got.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
        break
slow.close()
head, _, stream = got.partition(b"\r\n\r\n")
if not head.startswith(b"HTTP/1.1 200"):
    reflib.fail(f"the slow stream: {head[:200]}")
events = 0
raw = stream
# de-chunk (Transfer-Encoding: chunked)
out = b""
while raw:
    size_line, _, rest = raw.partition(b"\r\n")
    size = int(size_line, 16)
    if size == 0:
        break
    out += rest[:size]
    raw = rest[size + 2:]
for line in out.split(b"\n\n"):
    if line.startswith(b"data: {"):
        ev = json.loads(line[6:])
        events += len(ev["choices"][0]["logprobs"]["tokens"]) if ev["choices"][0]["logprobs"] else 0
if events != N_SLOW * T_SLOW or not out.rstrip().endswith(b"data: [DONE]"):
    reflib.fail(f"the slow client got {events} of {N_SLOW * T_SLOW} tokens")
print(f"ok  a client that stopped reading its stream (4 KB socket buffer): another request finished meanwhile; read "
      f"later, the stream held all {N_SLOW} x {T_SLOW} tokens ({len(out) / 2**20:.1f} MiB) and its end")
srv.stop()
