"""test_serve_errors.py: what `caraserve serve` does with bad input and through its lifecycle.

1. Every bad input of docs/errors.md's table gets its 4xx status and an OpenAI error object
   {"error": {"message", "type", "param", "code"}}, and a good request right after it succeeds.
   (Run with --print-table to print the table's rows.)
2. Disconnects: 20 streaming clients hang up mid-stream; /metrics shows running requests back
   to 0 and KV usage back to its idle value. A non-streaming client that hangs up while it
   waits has its request aborted too (section 4).
3. Unload while busy: unloading an adapter with requests in flight waits for them; they finish
   with the same tokens as alone; the adapter is gone afterwards.
4. --config FILE with the command line winning; SIGTERM lets an in-flight request finish and
   exits 0; --shutdown-timeout bounds the wait (the request ends as aborted) and still exits 0."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from serverlib import Server, make_tok_model, wait_for  # noqa: E402

transformers.utils.logging.disable_progress_bar()
KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
PRINT = "--print-table" in sys.argv

model_dir, ref, _ = make_tok_model("spm-32k", seed=7)
a1_dir, _ = make_adapter(model_dir, ref, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=21)
root = reflib.tmpdir("cs_root_")
outside = reflib.tmpdir("cs_outside_")
a_out, _ = make_adapter(model_dir, ref, r=4, alpha=8, targets=["q_proj"], seed=22)
os.rename(a_out, os.path.join(outside, "evil"))
os.symlink(os.path.join(outside, "evil"), os.path.join(root, "link-out"))
os.makedirs(os.path.join(root, "not-an-adapter"))
with open(os.path.join(root, "not-an-adapter", "adapter_config.json"), "w") as f:
    f.write("{\"r\": 8, \"peft_type\": \"LORA\"")  # truncated JSON

srv = Server(["--model", model_dir, "--served-model-name", "base", "--api-key", KEY, "--lora-modules", f"a1={a1_dir}",
              "--lora-root", root, "--threads", "2", "--kv-cache-bytes", "32M", "--max-model-len", "256",
              "--max-n", "16", "--max-body-bytes", "1M"])
srv.auth = AUTH

GOOD = {"model": "base", "prompt": "Hello", "max_tokens": 2}
LONG = "word " * 400
rows = []


def good_after(what):
    st, body, _ = srv.request("POST", "/v1/completions", GOOD, headers=AUTH)
    if st != 200 or body["choices"][0]["finish_reason"] not in ("length", "stop"):
        reflib.fail(f"after {what}: a good request got {st} {body}")


def expect(what, status, method="POST", path="/v1/completions", body=None, raw=None, headers=AUTH, param=None):
    st, resp, _ = srv.request(method, path, body, headers=headers, raw=raw)
    if st != status:
        reflib.fail(f"{what}: status {st}, want {status}: {resp}")
    if not isinstance(resp, dict) or set(resp.get("error", {})) != {"message", "type", "param", "code"}:
        reflib.fail(f"{what}: not an OpenAI error object: {resp!r}")
    e = resp["error"]
    if e["code"] != status or not e["message"]:
        reflib.fail(f"{what}: error object {e}")
    if param is not None and e["param"] != param:
        reflib.fail(f"{what}: param {e['param']!r}, want {param!r}")
    rows.append((what, status, e["message"]))
    good_after(what)


expect("malformed JSON", 400, raw=b'{"model": "base", "prompt": ')
expect("body is not an object", 400, raw=b'[1, 2, 3]')
expect("wrong type: prompt is a number", 400, body={"prompt": 123}, param="prompt")
expect("wrong type: max_tokens is a string", 400, body=dict(GOOD, max_tokens="ten"), param="max_tokens")
expect("wrong type: temperature is a string", 400, body=dict(GOOD, temperature="hot"), param="temperature")
expect("wrong type: stream is a string", 400, body=dict(GOOD, stream="yes"), param="stream")
expect("wrong type: n is 1.5", 400, body=dict(GOOD, n=1.5), param="n")
expect("wrong type: stop is a number", 400, body=dict(GOOD, stop=5), param="stop")
expect("wrong type: messages is a string", 400, path="/v1/chat/completions",
       body={"model": "base", "messages": "hi"}, param="messages")
expect("missing prompt", 400, body={"model": "base"}, param="prompt")
expect("empty prompt list", 400, body=dict(GOOD, prompt=[]), param="prompt")
expect("token id out of the vocabulary", 400, body=dict(GOOD, prompt=[1, 99999999]), param="prompt")
expect("unknown model", 404, body=dict(GOOD, model="no-such-model"), param="model")
expect("n = 0", 400, body=dict(GOOD, n=0), param="n")
expect("slo is a number", 400, body=dict(GOOD, slo=5), param="slo")
expect("slo.tpot_ms negative", 400, body=dict(GOOD, slo={"tpot_ms": -3}), param="slo")
expect("slo with an unknown key", 400, body=dict(GOOD, slo={"ttft": 100}), param="slo")
expect("n huge (100000)", 400, body=dict(GOOD, n=100000), param="n")
expect("max_tokens negative", 400, body=dict(GOOD, max_tokens=-1), param="max_tokens")
expect("max_tokens over the context", 400, body=dict(GOOD, max_tokens=100000), param="max_tokens")
expect("prompt over the context (256)", 400, body=dict(GOOD, prompt=LONG), param="prompt")
expect("prompt + max_tokens over the context", 400, body=dict(GOOD, prompt="word " * 100, max_tokens=200))
expect("logprobs 21 (> 20)", 400, body=dict(GOOD, logprobs=21), param="logprobs")
expect("temperature negative", 400, body=dict(GOOD, temperature=-1), param="temperature")
expect("top_p 0", 400, body=dict(GOOD, top_p=0), param="top_p")
expect("top_k -5", 400, body=dict(GOOD, top_k=-5), param="top_k")
expect("stop_token_ids out of range", 400, body=dict(GOOD, stop_token_ids=[10 ** 9]), param="stop_token_ids")
expect("max_tokens 0 without echo", 400, body=dict(GOOD, max_tokens=0), param="max_tokens")
expect("invalid UTF-8 in the body", 400, raw=b'{"model": "base", "prompt": "\xff\xfe bad"}')
expect("lone surrogate escape", 400, raw=b'{"model": "base", "prompt": "\\ud800"}')
big = os.path.join(reflib.tmpdir("cs_big_"), "body.json")
with open(big, "wb") as f:
    f.write(b"{" + b" " * (100 << 20) + b"}")
for how in ("curl", "chunked"):  # Content-Length (curl waits for 100-continue) and a chunked body
    cmd = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-H",
           f"Authorization: Bearer {KEY}", "--data-binary", f"@{big}", f"{srv.base}/v1/completions"]
    if how == "chunked":
        cmd[1:1] = ["-H", "Transfer-Encoding: chunked"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    out, _, code = p.stdout.rpartition("\n")
    if code != "413" or set(json.loads(out)["error"]) != {"message", "type", "param", "code"}:
        reflib.fail(f"100 MB body ({how}): {p.returncode} {code} {out[:300]} {p.stderr[:300]}")
    rows.append((f"100 MB body ({'Content-Length' if how == 'curl' else 'chunked'})", 413, json.loads(out)["error"]["message"]))
    good_after("100 MB body")
expect("empty messages", 400, path="/v1/chat/completions", body={"model": "base", "messages": []}, param="messages")
expect("message without a role", 400, path="/v1/chat/completions", body={"model": "base", "messages": [{"content": "x"}]},
       param="messages")
expect("unsupported chat_template construct", 400, path="/v1/chat/completions",
       body={"model": "base", "messages": [{"role": "user", "content": "x"}],
             "chat_template": "{% macro_nope %}{{ messages }}"}, param="chat_template")
expect("model without a chat template", 400, path="/v1/chat/completions",
       body={"model": "base", "messages": [{"role": "user", "content": "x"}]}, param="messages")
expect("response_format of an unknown type", 400, body=dict(GOOD, response_format={"type": "xml"}),
       param="response_format")
expect("a JSON schema keyword not supported", 400, body=dict(GOOD, guided_json={"type": "integer", "multipleOf": 3}),
       param="guided_json")
expect("a Lark grammar construct not supported", 400, body=dict(GOOD, guided_grammar='start: "a"\n%declare X\n'),
       param="guided_grammar")
expect("two structured-output constraints", 400, body=dict(GOOD, guided_regex="a", guided_choice=["b"]),
       param="guided_choice")
expect("tool_choice required without tools", 400, path="/v1/chat/completions",
       body={"model": "base", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
             "chat_template": "{{ messages[0].content }}"}, param="tool_choice")
expect("missing API key", 401, headers={})
expect("wrong API key", 401, headers={"Authorization": "Bearer sk-wrong"})
expect("unknown route", 404, path="/v1/nothing-here", body={})
expect("wrong method (GET /v1/completions)", 405, method="GET")
expect("unknown adapter path", 404, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": os.path.join(root, "missing")}, param="lora_path")
expect("path traversal (../)", 403, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": os.path.join(root, "..", os.path.basename(outside), "evil")},
       param="lora_path")
expect("symlink out of --lora-root", 403, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": os.path.join(root, "link-out")}, param="lora_path")
expect("a missing path outside the root (no existence oracle)", 403, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": "/nonexistent/dir"}, param="lora_path")
os.makedirs(os.path.join(root, "file-link"))
os.symlink(os.path.join(outside, "evil", "adapter_config.json"), os.path.join(root, "file-link", "adapter_config.json"))
os.symlink(os.path.join(outside, "evil", "adapter_model.safetensors"),
           os.path.join(root, "file-link", "adapter_model.safetensors"))
expect("adapter files symlinked out of the root", 403, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": os.path.join(root, "file-link")}, param="lora_path")
expect("not an adapter inside the root", 400, path="/v1/load_lora_adapter",
       body={"lora_name": "x", "lora_path": os.path.join(root, "not-an-adapter")}, param="lora_path")
expect("unload an unknown adapter", 404, path="/v1/unload_lora_adapter", body={"lora_name": "nope"}, param="lora_name")


# request framing (RFC 9112 section 6), on raw sockets: a request whose body length is
# ambiguous is answered and its connection closed, so the bytes after it never run as a
# second (smuggled) request; the server reads until it closes, and exactly one answer came
def raw_exchange(data):
    got = srv.raw(data, "framing")
    heads, i = [], 0  # where each answer starts: status line, headers, Content-Length bytes
    while i < len(got) and got.startswith(b"HTTP/1.1 ", i):
        heads.append(i)
        end = got.find(b"\r\n\r\n", i)
        if end < 0:
            break
        lens = [int(line.split(b":", 1)[1]) for line in got[i:end].split(b"\r\n")
                if line.lower().startswith(b"content-length:")]
        i = end + 4 + (lens[0] if lens else 0)
    if i < len(got):
        heads.append(i)  # bytes that are not a well-formed answer count as one more
    return got, heads


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + \
    b"\r\nContent-Type: application/json\r\n"


def framing(what, status, data, needle):
    got, heads = raw_exchange(data)
    if len(heads) != 1 or not got.startswith(b"HTTP/1.1 %d " % status):
        reflib.fail(f"{what}: want one answer {status} and the connection closed, got {len(heads)}: {got[:600]!r}")
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    e = body["error"]
    if set(e) != {"message", "type", "param", "code"} or e["code"] != status or needle not in e["message"]:
        reflib.fail(f"{what}: error object {e}")
    rows.append((what, status, e["message"]))
    good_after(what)


framing("two Content-Length headers (a request smuggled after the body)", 400,
        HEAD + b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED, "Content-Length")
framing("Content-Length and Transfer-Encoding: chunked together", 400,
        HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n" + SMUGGLED, "Transfer-Encoding")
# (libmicrohttpd refuses a Content-Length that is not a number itself, before the server sees
# the request, with a page of its own: what matters is that nothing after it ran)
got, heads = raw_exchange(HEAD + b"Content-Length: 12abc\r\n\r\n{}" + SMUGGLED)
if not got.startswith(b"HTTP/1.1 400 ") or b" 200 " in got or b'"object"' in got:
    reflib.fail(f"Content-Length not a number: {got[:600]!r}")
good_after("Content-Length not a number")
framing("Transfer-Encoding: gzip (not supported)", 501, HEAD + b"Transfer-Encoding: gzip\r\n\r\n\x1f\x8b\x08\x00",
        "gzip")
# the control: two well-framed requests on one connection both run (the counting above can fail)
body = json.dumps(GOOD).encode()
got, heads = raw_exchange(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body + SMUGGLED.replace(
    b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
if len(heads) != 2 or not all(got.startswith(b"HTTP/1.1 200 ", h) for h in heads):
    reflib.fail(f"two well-framed requests on one connection: {len(heads)} answers: {got[:600]!r}")
print("ok  request framing: ambiguous lengths 400, gzip 501, each closes its connection; keep-alive still serves two")
if PRINT:
    for what, st, msg in rows:
        print(f"| {what} | {st} | {msg.replace('|', '/')} |")
print(f"ok  {len(rows)} bad inputs: each a 4xx (501 for an unsupported Transfer-Encoding) with an error object, and the "
      "server kept serving")

# ---- 2. disconnects ----
# (the engine publishes its gauges after each iteration: the last request's may lag by one)
vals = wait_for(lambda: (lambda v: v if v["caraserve_num_requests_running"] == 0 else None)(srv.metrics()[1]), 120,
                "the server to be idle before the disconnect test")
idle_kv = vals["caraserve_kv_cache_usage_perc"]


def hang_up(i, started):
    body = json.dumps({"model": "a1" if i % 2 else "base", "prompt": f"Story number {i}:", "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 2:
        d = s.recv(4096)
        if not d:
            break
        got += d
    started.append(got.count(b"data: "))
    s.close()


started = []
ts = [threading.Thread(target=hang_up, args=(i, started)) for i in range(20)]
for t in ts:
    t.start()
for t in ts:
    t.join()
if len(started) != 20 or min(started) < 2:
    reflib.fail(f"disconnect clients did not all get tokens: {started}")


def idle():
    _, v = srv.metrics()
    return v["caraserve_num_requests_running"] == 0 and v["caraserve_num_requests_waiting"] == 0 and \
        v["caraserve_kv_cache_usage_perc"] == idle_kv and v


v = wait_for(idle, 120, "running requests and KV usage back to idle after 20 disconnects")
aborted = sum(val for k, val in v.items() if k.startswith("caraserve_request_success_total") and 'finished_reason="abort"' in k)
if aborted < 20:
    reflib.fail(f"{aborted} requests counted as aborted, want 20")
good_after("20 disconnects")
print(f"ok  20 streaming clients hung up: running 0, KV usage back to {idle_kv}, {int(aborted)} aborted")

# ---- 3. unload while busy ----
req = {"model": "a1", "prompt": "The long road", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
st, alone, _ = srv.request("POST", "/v1/completions", req, headers=AUTH)
if st != 200:
    reflib.fail(f"a1 alone: {st} {alone}")
results = []


def busy():
    results.append(srv.request("POST", "/v1/completions", req, headers=AUTH)[:2])


# the state this section needs, made rather than waited for: the engine held, four a1 requests
# accepted behind it (in flight for the server: they pin the adapter), then the unload
srv.settle()
A1_DONE = 'caraserve_request_success_total{adapter="a1",finished_reason="length"}'
a1_done = srv.metrics()[1].get(A1_DONE, 0)
srv.pause("keep")
ts = [threading.Thread(target=busy) for _ in range(4)]
for t in ts:
    t.start()
wait_for(lambda: srv.metrics()[1]["caraserve_num_requests_waiting"] >= 4, 120, "the four a1 requests to be queued")
unload = []
tu = threading.Thread(target=lambda: unload.append(srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"},
                                                               headers=AUTH)[:2]))
tu.start()
# a1 leaves /v1/models at once (new requests for it get 404): the unload has begun
wait_for(lambda: "a1" not in [m["id"] for m in srv.request("GET", "/v1/models", headers=AUTH)[1]["data"]], 120,
         "a1 to leave /v1/models")
if unload or not all(t.is_alive() for t in ts):
    reflib.fail(f"the unload answered while its four requests were held: {unload} {results}")
srv.resume()
tu.join()
for t in ts:
    t.join()
st, body = unload[0]
if st != 200:
    reflib.fail(f"unload while busy: {st} {body}")
if len(results) != 4:
    reflib.fail(f"in-flight requests: {results}")
for st, body in results:
    if st != 200 or body["choices"][0]["text"] != alone["choices"][0]["text"] or \
            body["choices"][0]["finish_reason"] != "length":
        reflib.fail(f"a request in flight during the unload: {st} {body}")
if srv.metrics()[1].get(A1_DONE, 0) != a1_done + 4:
    reflib.fail(f"a1 requests finished: {srv.metrics()[1].get(A1_DONE, 0)}, want {a1_done + 4}")
st, body, _ = srv.request("POST", "/v1/completions", req, headers=AUTH)
if st != 404:
    reflib.fail(f"a1 after unload: {st} {body}")
print("ok  unload while busy: 4 in-flight requests finished with their tokens, then the adapter was gone")
if srv.stop() != 0:
    reflib.fail("exit status after SIGTERM")

# ---- 4. config file, SIGTERM drain, shutdown timeout ----
p = subprocess.run([reflib.CARASERVE, "serve", "--config", os.path.join(reflib.SRCDIR, "etc", "caraserve.conf"), "--help"],
                   capture_output=True, text=True)
if p.returncode != 0:
    reflib.fail(f"etc/caraserve.conf does not parse: {p.stderr}")
bad = os.path.join(reflib.tmpdir("cs_badconf_"), "bad.conf")
with open(bad, "w") as f:
    f.write("model = /x\nno-such-option = 1\n")
p = subprocess.run([reflib.CARASERVE, "serve", "--config", bad], capture_output=True, text=True)
if p.returncode == 0 or "bad.conf:2: unknown option 'no-such-option'" not in p.stderr:
    reflib.fail(f"a bad config line: {p.returncode} {p.stderr}")
conf = os.path.join(reflib.tmpdir("cs_conf_"), "caraserve.conf")
with open(conf, "w") as f:
    f.write(f"# test config\nmodel = {model_dir}\nserved-model-name = fromconf\nmax-n = 3\nthreads = 2\n"
            "kv-cache-bytes = 32M\nno-prefix-caching = true\n")
bad_tmpl = os.path.join(reflib.tmpdir("cs_tmpl_"), "bad.jinja")
with open(bad_tmpl, "w") as f:
    f.write("{% for m in messages %}\n{{ m.content | no_such_filter }}\n{% endfor %}")
p = subprocess.run([reflib.CARASERVE, "serve", "--model", model_dir, "--port", "0", "--chat-template", bad_tmpl],
                   capture_output=True, text=True, timeout=120)
if p.returncode != 1 or "no_such_filter" not in p.stderr or "line 2" not in p.stderr:
    reflib.fail(f"an unsupported template construct must stop the server at start-up: {p.returncode} {p.stderr}")
print("ok  a chat template with an unknown filter stops start-up: " + p.stderr.strip().splitlines()[-1])
s2 = Server(["--config", conf, "--max-n", "5"])
st, body, _ = s2.request("POST", "/v1/completions", {"model": "fromconf", "prompt": "Hi", "max_tokens": 2, "n": 5})
if st != 200 or len(body["choices"]) != 5:
    reflib.fail(f"config + CLI override: {st} {body}")
st, body, _ = s2.request("POST", "/v1/completions", {"model": "fromconf", "prompt": "Hi", "max_tokens": 2, "n": 6})
if st != 400:
    reflib.fail(f"--max-n 5 from the command line must win over the file's 3: {st}")
# the request is accepted behind a held engine before the signal: in flight by construction
s2.settle()
s2.pause("keep")
res = []
th = threading.Thread(target=lambda: res.append(s2.request("POST", "/v1/completions",
                                                           {"model": "fromconf", "prompt": "Go", "max_tokens": 150,
                                                            "ignore_eos": True})))
th.start()
wait_for(lambda: s2.metrics()[1]["caraserve_num_requests_waiting"] >= 1, 120, "the request to be queued")
s2.proc.send_signal(signal.SIGTERM)  # draining lifts the pause: the request runs to its end
th.join()
rc = s2.stop()
if rc != 0 or res[0][0] != 200 or res[0][1]["choices"][0]["finish_reason"] != "length" or \
        res[0][1]["usage"]["completion_tokens"] != 150:
    reflib.fail(f"SIGTERM drain: exit {rc}, {res}")
print("ok  --config with the command line winning; SIGTERM finishes the in-flight request, exit 0")

LONG_GEN = 50000  # far more tokens than --shutdown-timeout 0.3 s can produce
s3 = Server(["--model", model_dir, "--threads", "2", "--kv-cache-bytes", "32M", "--shutdown-timeout", "0.3",
             "--max-model-len", str(LONG_GEN + 64)])
# a non-streaming client that hangs up: its connection is suspended (MHD does not see the
# hang-up then); the server's watcher does, and aborts the request. The request is held
# running (a token generated, the engine paused) when the client hangs up.
ABORTED = 'caraserve_request_success_total{adapter="' + os.path.basename(model_dir) + '",finished_reason="abort"}'
GEN = 'caraserve_generation_tokens_total{adapter="' + os.path.basename(model_dir) + '"}'
socks = []


def send_and_hang_on():
    sock = socket.create_connection(("127.0.0.1", s3.port))
    body = json.dumps({"prompt": "Go on", "max_tokens": LONG_GEN, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    socks.append(sock)
    return []


s3.hold_running(send_and_hang_on, "the request of the client that will hang up")
aborted0 = s3.metrics()[1].get(ABORTED, 0)
socks[-1].close()
v = wait_for(lambda: (lambda v: v if v.get(ABORTED, 0) == aborted0 + 1 else None)(s3.metrics()[1]), 120,
             "the hung-up non-streaming request to be aborted")
s3.resume()
gen = v[GEN]
if gen >= LONG_GEN:
    reflib.fail(f"the hung-up request generated {gen} tokens")
print(f"ok  a non-streaming client that hangs up while its request runs: aborted after {int(gen)} of {LONG_GEN} tokens")
def long_request(server):
    return server.request("POST", "/v1/completions", {"prompt": "Go", "max_tokens": LONG_GEN, "ignore_eos": True})


th, res = s3.hold_call(lambda: long_request(s3), "the long request")
s3.proc.send_signal(signal.SIGINT)  # draining lifts the pause; 0.3 s later the request is aborted
th.join()
rc = s3.stop()
if rc != 0 or res[0][0] != 200 or res[0][1]["choices"][0]["finish_reason"] != "abort" or \
        not 0 < res[0][1]["usage"]["completion_tokens"] < LONG_GEN:
    reflib.fail(f"--shutdown-timeout: exit {rc}, {res[0][0]}, {res[0][1].get('usage')}")
print("ok  SIGINT with --shutdown-timeout 0.3: the long request ends as aborted, exit 0")

# while a drain lasts the server still answers: /health 503, a new generation request 503,
# and the request in flight goes on; a second signal stops the wait (SIGINT: do not wait)
s4 = Server(["--model", model_dir, "--threads", "2", "--kv-cache-bytes", "32M", "--shutdown-timeout", "600",
             "--max-model-len", str(LONG_GEN + 64)])
th, res = s4.hold_call(lambda: long_request(s4), "the long request")
s4.resume()
s4.proc.send_signal(signal.SIGTERM)
wait_for(lambda: s4.request("GET", "/health")[0] == 503 or None, 120, "/health to say 503 once the drain began")
st, body, _ = s4.request("GET", "/health")
if st != 503 or "shutting down" not in body["error"]["message"]:
    reflib.fail(f"/health while draining: {st} {body}")
st, body, _ = s4.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
if st != 503 or "shutting down" not in body["error"]["message"]:
    reflib.fail(f"a new completion while draining: {st} {body}")
if not th.is_alive() or res:
    reflib.fail(f"the request in flight ended before the drain was stopped: {res}")
s4.proc.send_signal(signal.SIGINT)  # the second signal: stop waiting, abort what runs
th.join()
rc = s4.stop()
if rc != 0 or res[0][0] != 200 or res[0][1]["choices"][0]["finish_reason"] != "abort":
    reflib.fail(f"a second signal during the drain: exit {rc}, {res[0][0]}, {res[0][1].get('usage')}")
print("ok  while draining: /health 503, a new request 503 'shutting down', the running request goes on until a "
      "second signal aborts it; exit 0")
