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
import subprocess
import threading
import time

import reflib


class Server:
    def __init__(self, args, env=None, wait_ready=True, timeout=120):
        self.cmd = [reflib.CARASERVE, "serve", "--host", "127.0.0.1", "--port", "0", *args]
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
        st, txt, _ = self.request("GET", "/metrics")
        if st != 200:
            reflib.fail(f"/metrics answered {st}: {txt}")
        vals = {}
        for line in txt.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
        return txt, vals

    def settle(self, timeout=30):
        """Wait until nothing runs or waits. The gauges are published after each engine
        iteration, so right after a response they may still count the request just answered:
        a test that waits for its own request to show up as running settles first."""
        wait_for(lambda: (lambda v: v["caraserve_num_requests_running"] == 0 and
                          v["caraserve_num_requests_waiting"] == 0)(self.metrics()[1]), timeout, "the server to settle")

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


def wait_for(pred, timeout=30, what="condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    reflib.fail(f"timed out waiting for {what}")
