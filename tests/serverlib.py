"""serverlib.py: start `caraserve serve` on a free loopback port for end-to-end tests, talk to
it with plain HTTP (http.client) next to the official openai client, and build the small
models the tests serve (transformers-written, with a real tokenizer)."""
import atexit
import http.client
import json
import lzma
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import reflib


class Server:
    def __init__(self, args, env=None, wait_ready=True, timeout=120, command="serve"):
        """COMMAND "router": `caraserve router`, which has no model to load (ready once
        listening; wait for its /health yourself)"""
        self.cmd = [reflib.CARASERVE, command, "--host", "127.0.0.1", "--port", "0", *args]
        wait_ready = wait_ready and command == "serve"
        self.auth = {}  # headers for the helpers' own control requests (pause, resume): an API key
        self.lines = []
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})))
        atexit.register(self.kill)  # a failing test must not leave its server running
        self.port = None
        self._ready = threading.Event()
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._listening.wait(timeout):
            self.kill()
            reflib.fail(f"server did not start listening: {' '.join(self.cmd)}\n" + "".join(self.lines))
        if wait_ready and not self._ready.wait(timeout):
            self.kill()
            reflib.fail(f"server did not become ready: {' '.join(self.cmd)}\n" + "".join(self.lines))

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://[^ ]*:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self._listening.set()
            if "caraserve: ready:" in line:
                self._ready.set()
        self._listening.set()

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def request(self, method, path, body=None, headers=None, raw=None, timeout=300):
        """(status, parsed JSON or text, headers)"""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = dict(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        txt = r.read()
        c.close()
        try:
            return r.status, json.loads(txt), r.headers
        except ValueError:
            return r.status, txt.decode("utf-8", "replace"), r.headers

    def metrics(self):
        st, txt, _ = self.request("GET", "/metrics", headers=self.auth)  # a key only with tenants
        if st != 200:
            reflib.fail(f"/metrics answered {st}: {txt}")
        vals = {}
        for line in txt.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
        return txt, vals

    def settle(self, timeout=120):
        """Wait until nothing runs or waits. The gauges are published after each engine
        iteration, so right after a response they may still count the request just answered:
        a test that waits for its own request to show up as running settles first."""
        wait_for(lambda: (lambda v: v["caraserve_num_requests_running"] == 0 and
                          v["caraserve_num_requests_waiting"] == 0)(self.metrics()[1]), timeout, "the server to settle")

    def gen_tokens(self):
        """generated tokens so far, all adapters (a counter the engine thread bumps per token)"""
        return sum(v for k, v in self.metrics()[1].items() if k.startswith("caraserve_generation_tokens_total"))

    def pause(self, mode="keep"):
        """POST /v1/pause: with keep it answers once the iteration under way has ended, so no
        token is produced after it returns and the gauges show the held state exactly"""
        st, body, _ = self.request("POST", "/v1/pause", {"mode": mode}, headers=self.auth)
        if st != 200:
            reflib.fail(f"/v1/pause {mode}: {st} {body}")
        return body

    def resume(self):
        st, body, _ = self.request("POST", "/v1/resume", {}, headers=self.auth)
        if st != 200:
            reflib.fail(f"/v1/resume: {st} {body}")

    def hold_running(self, start, what="the request", tries=10, pause=None, resume=None):
        """Create the state "one request is running, has generated at least one token, and the
        engine is held (pause keep)" instead of polling for it and hoping. start() sends the
        request on other threads and returns them. Once a token has come, the engine is paused;
        the running gauge is exact while it is held. If the request finished before the pause
        (it should be long), the engine resumes, the threads are joined and it starts again.
        Returns the threads of the held request; the caller resumes the engine. pause and
        resume: other calls to hold and release it by (vLLM's or SGLang's routes)."""
        for _ in range(tries):
            self.settle()
            g0 = self.gen_tokens()
            threads = start()
            wait_for(lambda: self.gen_tokens() > g0, 120, f"{what} to generate a token", interval=0.005)
            (pause or (lambda: self.pause("keep")))()
            if self.metrics()[1]["caraserve_num_requests_running"] >= 1:
                return threads
            (resume or self.resume)()
            for t in threads:
                t.join()
        reflib.fail(f"{what} finished before the engine could be paused, {tries} times")

    def hold_call(self, call, what="the request"):
        """hold_running for one request: CALL() runs on a thread of its own (a new one on each
        try). Returns that thread and the list its result is appended to once CALL returns
        (emptied on each try); the caller resumes the engine."""
        res = []

        def start():
            res.clear()
            th = threading.Thread(target=lambda: res.append(call()))
            th.start()
            return [th]
        return self.hold_running(start, what)[0], res

    def raw(self, data, what="a raw request"):
        """Send DATA on a new connection and read until the server closes it (the bytes)."""
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(120)  # a bound on a hang, not a timing assertion
        sock.sendall(data)
        got = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return got
                got += chunk
        except socket.timeout:
            reflib.fail(f"{what}: the server neither answered nor closed: got {got[:300]!r}")
        finally:
            sock.close()

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            reflib.fail("server did not exit after the signal\n" + "".join(self.lines[-20:]))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def tokenizer_dir(name):
    """the vendored tokenizer files of tests/data/tokenizers/NAME, decompressed"""
    src = os.path.join(reflib.SRCDIR, "tests", "data", "tokenizers", name)
    d = reflib.tmpdir(f"cs_tok_{name}_")
    for fn in os.listdir(src):
        if fn.endswith(".xz"):
            with lzma.open(os.path.join(src, fn)) as f, open(os.path.join(d, fn[:-3]), "wb") as g:
                g.write(f.read())
        else:
            shutil.copy(os.path.join(src, fn), d)
    return d


def make_tok_model(tok_name, seed=0, hidden=64, layers=2, tied=True):
    """A random-weight Llama checkpoint written by transformers with the vocabulary of a real
    tokenizer (its files copied in). Returns (dir, float32 reference model, tokenizer dir)."""
    import torch
    import transformers
    from hfmodels import perturb
    from tokenizers import Tokenizer
    td = tokenizer_dir(tok_name)
    vocab = Tokenizer.from_file(os.path.join(td, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    perturb(model, seed)
    if tied:
        model.tie_weights()
    d = reflib.tmpdir(f"cs_srv_{tok_name}_")
    model.save_pretrained(d, safe_serialization=True)
    for fn in os.listdir(td):
        shutil.copy(os.path.join(td, fn), d)
    ref = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return d, ref, td


def set_chat_template(model_dir, name):
    """write tests/data/chat_templates/NAME.jinja into MODEL_DIR's tokenizer_config.json"""
    with open(os.path.join(reflib.SRCDIR, "tests", "data", "chat_templates", name + ".jinja")) as f:
        template = f.read()
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        tc = json.load(f)
    tc["chat_template"] = template
    with open(path, "w") as f:
        json.dump(tc, f)


def wait_for(pred, timeout=30, what="condition", interval=0.05):
    """Wait for a state that, once reached, stays (a request queued behind a paused engine, a
    counter that only grows, an adapter gone): never for a passing moment. The timeout is
    only a safety net against a hung server."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    reflib.fail(f"timed out waiting for {what}")
