"""test_adapter_slo.py: per-model SLOs from `caraserve serve --adapter-slos FILE`.

A server reads the file through --config (`adapter-slos = FILE`). Requests without an `slo` of
their own get their model's bounds, and /metrics' slo_requests_total / slo_attained_total show
it: an adapter whose TTFT bound is 0.01 ms (no first token comes that fast) misses, one whose
bounds are 10 minutes meets them, through completions, chat, /v1/rollout and SGLang's
/generate. A request's own slo wins field by field; "*" covers unlisted adapters; a null bound
(the base model's entry here) means none, so "*" does not fill it and the request is not
counted; an adapter loaded over HTTP later finds its entry by name; /v1/models shows each
model's bounds. A bad file (not JSON, an unknown key, a bound <= 0, an entry that is not an
object, a name twice, no file) stops the server at start-up, exit 1, with a message naming the
file and the entry. Nothing here depends on timing beyond 0.01 ms (never met) and 10 minutes
(always met). Standard library only."""
import json
import shutil
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402
from serverlib import Server, tokenizer_dir  # noqa: E402

FOREVER = 600000  # 10 minutes, in ms: always met
NEVER = 0.01      # 10 microseconds: no first token comes that fast

root = reflib.tmpdir("cs_aslo_")
model = os.path.join(root, "m")
subprocess.run([reflib.MKMODEL, "model", "--out", model, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--intermediate", "96", "--dtype", "bf16", "--tokenizer", tokenizer_dir("spm-32k"), "--init-std", "0.1"],
               check=True, capture_output=True)
lora_root = os.path.join(root, "adapters")
for name, rank in (("strict", 8), ("easy", 16), ("other", 4), ("late", 4)):
    subprocess.run([reflib.MKMODEL, "adapter", "--model", model, "--out", os.path.join(lora_root, name), "--rank",
                    str(rank), "--targets", "q,v", "--seed", str(rank)], check=True, capture_output=True)

slos = os.path.join(root, "slos.json")
with open(slos, "w") as f:
    json.dump({"strict": {"ttft_ms": NEVER}, "easy": {"ttft_ms": FOREVER, "tpot_ms": FOREVER},
               "late": {"ttft_ms": FOREVER}, "base": {"ttft_ms": None}, "*": {"ttft_ms": NEVER, "tpot_ms": FOREVER}}, f)
conf = os.path.join(root, "serve.conf")
with open(conf, "w") as f:
    f.write(f"adapter-slos = {slos}\n")

srv = Server(["--config", conf, "--model", model, "--served-model-name", "base", "--threads", "2",
              "--kv-cache-bytes", "32M", "--lora-modules", *(f"{n}={os.path.join(lora_root, n)}" for n in ("strict", "easy", "other")),
              "--lora-root", lora_root, "--chat-template",
              os.path.join(reflib.SRCDIR, "tests", "data", "chat_templates", "chatml.jinja")])
RANK = {"strict": 8, "easy": 16, "other": 4, "late": 4, "base": 0}


def ok(st, body, what):
    if st != 200:
        reflib.fail(f"{what}: {st} {body}")
    return body


def complete(model_name, slo=None):
    body = {"model": model_name, "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True}
    if slo is not None:
        body["slo"] = slo
    return ok(*srv.request("POST", "/v1/completions", body)[:2], f"completion on {model_name} slo {slo}")


def counts(name):
    _, vals = srv.metrics()
    lab = f'{{adapter="{name}",rank="{RANK[name]}"}}'
    return (vals.get(f"caraserve_slo_requests_total{lab}", 0), vals.get(f"caraserve_slo_attained_total{lab}", 0))


def expect_counts(name, want, what):
    got = counts(name)
    if got != want:
        reflib.fail(f"{what}: {name}: slo requests/attained {got}, want {want}\n{srv.metrics()[0]}")


# ---- 1. the file's bounds reach the accounting ----
complete("strict")
complete("easy")
expect_counts("strict", (1, 0), "strict adapter (TTFT 0.01 ms), no slo of its own")
expect_counts("easy", (1, 1), "easy adapter (10 min), no slo of its own")
print("ok  requests without an slo get their adapter's from --adapter-slos (via --config): one missed, one met")

# the request's own bounds win, field by field
complete("strict", {"ttft_ms": FOREVER})
expect_counts("strict", (2, 1), "strict adapter, the request's own generous TTFT")
complete("strict", {"tpot_ms": FOREVER})  # TTFT still the file's 0.01 ms
expect_counts("strict", (3, 1), "strict adapter, the request's own TPOT only")
print("ok  a request's own slo wins, field by field (its TTFT met; its TPOT alone leaves the file's TTFT)")

# "*" for an adapter without an entry; null in the base model's entry: no SLO, "*" does not fill it
complete("other")
expect_counts("other", (1, 0), "unlisted adapter (\"*\": TTFT 0.01 ms)")
# the base model's entry nulls the TTFT only: none, though "*" has 0.01 ms; "*"'s TPOT (10 min) applies
complete("base")
expect_counts("base", (1, 1), "base model (its TTFT null, TPOT from \"*\")")
complete("base", {"ttft_ms": NEVER})
expect_counts("base", (2, 1), "base model with its own impossible TTFT")
print("ok  \"*\" covers unlisted adapters and the base model; a null bound is none (\"*\" does not fill it)")

# chat goes the same way
ok(*srv.request("POST", "/v1/chat/completions", {"model": "strict", "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 3, "ignore_eos": True})[:2], "chat on strict")
expect_counts("strict", (4, 1), "chat on the strict adapter")
print("ok  chat completions get the adapter's SLO too")

# ---- 2. rollout and SGLang's /generate ----
ro = {"groups": [{"input_ids": [1, 15043, 727], "n": 2}], "sampling": {"max_tokens": 3, "ignore_eos": True}}
ok(*srv.request("POST", "/v1/rollout", dict(ro, adapter="easy"))[:2], "rollout on easy")
expect_counts("easy", (2, 2), "a rollout group on the easy adapter")
ok(*srv.request("POST", "/v1/rollout", dict(ro, adapter="strict"))[:2], "rollout on strict")
expect_counts("strict", (5, 1), "a rollout group on the strict adapter")
ok(*srv.request("POST", "/v1/rollout", dict(ro, adapter="strict", slo={"ttft_ms": FOREVER}))[:2], "rollout, own slo")
expect_counts("strict", (6, 2), "a rollout group on the strict adapter with its own generous TTFT")
ok(*srv.request("POST", "/generate", {"input_ids": [1, 15043], "lora_path": "strict",
                                      "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})[:2], "/generate")
expect_counts("strict", (7, 2), "SGLang /generate on the strict adapter")
print("ok  /v1/rollout groups and /generate get the adapter's SLO (request's own wins) and are counted")

# ---- 3. an adapter loaded later finds its entry by name; /v1/models shows the bounds ----
ok(*srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": os.path.join(lora_root, "late")})[:2],
   "load late")
complete("late")
expect_counts("late", (1, 1), "adapter loaded over HTTP (its entry: 10 min)")
models = {m["id"]: m for m in ok(*srv.request("GET", "/v1/models")[:2], "/v1/models")["data"]}
want = {"strict": {"ttft_ms": NEVER, "tpot_ms": FOREVER}, "easy": {"ttft_ms": FOREVER, "tpot_ms": FOREVER},
        "other": {"ttft_ms": NEVER, "tpot_ms": FOREVER}, "late": {"ttft_ms": FOREVER, "tpot_ms": FOREVER},
        "base": {"ttft_ms": None, "tpot_ms": FOREVER}}
for name, w in want.items():
    if models.get(name, {}).get("slo") != w:
        reflib.fail(f"/v1/models: {name}: slo {models.get(name, {}).get('slo')}, want {w}\n{models}")
print("ok  an adapter loaded over HTTP gets its entry; /v1/models lists each model's SLO")
rc = srv.stop()
if rc != 0:
    reflib.fail(f"server exit {rc} after SIGTERM")

# ---- 4. bad files stop the start ----
p = subprocess.run([reflib.CARASERVE, "serve", "--help"], capture_output=True, text=True)
if p.returncode != 0 or "--adapter-slos FILE" not in p.stdout:
    reflib.fail(f"serve --help does not list --adapter-slos: {p.returncode}\n{p.stdout}")


def refused(content, want, via_config=False, path=None):
    path = path or os.path.join(root, "bad.json")
    if content is not None:
        with open(path, "w") as f:
            f.write(content)
    args = ["--adapter-slos", path]
    if via_config:
        c = os.path.join(root, "bad.conf")
        with open(c, "w") as f:
            f.write(f"adapter-slos = {path}\n")
        args = ["--config", c]
    p = subprocess.run([reflib.CARASERVE, "serve", "--model", model, "--port", "0", *args], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 1 or f"--adapter-slos {path}: " not in p.stderr or want not in p.stderr:
        reflib.fail(f"--adapter-slos with {content!r}: exit {p.returncode}, want 1 and a message with {want!r}:\n{p.stderr}")
    return p.stderr.strip().splitlines()[-1]


for content, want, conf_ in [
    ("{\"strict\": {\"ttft_ms\": 100", "not valid JSON", False),
    ("{\"strict\": {\"ttft\": 100}}", "\"strict\": slo.ttft: unknown (slo has ttft_ms and tpot_ms)", False),
    ("{\"easy\": {\"tpot_ms\": -5}}", "\"easy\": slo.tpot_ms must be a number of milliseconds > 0", False),
    ("{\"*\": {\"ttft_ms\": 0}}", "\"*\": slo.ttft_ms must be a number of milliseconds > 0", True),
    ("{\"easy\": 150}", "\"easy\": 'slo' must be an object", False),
    ("[{\"ttft_ms\": 1}]", "must be a JSON object", False),
    ("{\"easy\": {\"ttft_ms\": 1}, \"easy\": {\"ttft_ms\": 2}}", "duplicate", False),
]:
    line = refused(content, want, conf_)
    print(f"ok  refused{' (through --config)' if conf_ else ''}: {line}")
line = refused(None, "No such file", path=os.path.join(root, "missing.json"))
print(f"ok  refused: {line}")
shutil.rmtree(root, ignore_errors=True)
