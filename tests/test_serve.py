"""test_serve.py: `caraserve serve` end to end, through the official openai client and plain HTTP,
against transformers + peft.

1. Echo + logprobs: the prompt tokens' logprobs and every generated token's logprob and top-3
   alternatives equal transformers (+ peft) within 1e-4 (float32 weights) for the base model and
   two adapters; return_tokens_as_token_ids gives the ids; greedy tokens are the argmax;
   echo with max_tokens 0 scores the prompt only.
2. Completions: n > 1 with a seed (reproducible, one choice per index), streaming (the deltas
   add up to the non-streamed text; include_usage), a batch of prompts, token-id prompts, stop.
3. Chat: the server's rendering (/tokenize with messages, as vLLM accepts it) equals
   transformers' apply_chat_template token for token for at least 20 conversations per template (up to 38)
   (Llama-3.1, Qwen3, Gemma 3 and the vendored Llama-2, Mistral, ChatML templates), through a
   request's chat_template and through a model's own tokenizer_config.json (Llama-3.1);
   chat completions, streamed and not, generate from exactly that prompt.
4. /v1/models, /tokenize, /detokenize, adapters loaded, replaced (load_inplace) and unloaded
   over HTTP, and /metrics through promtool."""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from openai import OpenAI  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from serverlib import Server, make_tok_model  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4
KEY = "sk-caraserve-test"

model_dir, ref_base, tokdir = make_tok_model("spm-32k", seed=3)
hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)  # apply_chat_template: the rendering truth
# token ids: Hugging Face `tokenizers` on the tokenizer.json (transformers 5 rewrites Llama-2-style
# tokenizers with a Metaspace pre-tokenizer, which splits text after special tokens differently)
raw_tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def enc(text, special=True):
    return raw_tok.encode(text, add_special_tokens=special).ids
a1_dir, ref_a1 = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=11)
a2_dir, ref_a2 = make_adapter(model_dir, ref_base, r=16, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"], seed=12)
root = reflib.tmpdir("cs_lora_root_")
a3_dir, ref_a3 = make_adapter(model_dir, ref_base, r=4, alpha=8, targets=["q_proj", "o_proj"], seed=13)
a3b_dir, ref_a3b = make_adapter(model_dir, ref_base, r=4, alpha=8, targets=["q_proj", "o_proj"], seed=14)
shutil.copytree(a3_dir, os.path.join(root, "a3"))
shutil.copytree(a3b_dir, os.path.join(root, "a3b"))

srv = Server(["--model", model_dir, "--served-model-name", "base", "--api-key", KEY, "--lora-modules",
              f"a1={a1_dir}", f"a2={a2_dir}", "--lora-root", root, "--threads", "2", "--kv-cache-bytes", "64M"])
client = OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=300)
AUTH = {"Authorization": f"Bearer {KEY}"}


def lsm_of(ref, ids):
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].double().numpy()
    return reflib.log_softmax64(logits)


def check_echo(model_name, ref, prompt, max_tokens, what):
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=3,
                                  echo=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    ch = r.choices[0]
    lp = ch.logprobs
    ids = [int(t.split(":")[1]) for t in lp.tokens]
    want_prompt = enc(prompt)
    n_p = len(want_prompt)
    if ids[:n_p] != want_prompt:
        reflib.fail(f"{what}: echoed prompt ids {ids[:n_p]} != tokenizer {want_prompt}")
    if len(ids) != n_p + max_tokens or r.usage.completion_tokens != max_tokens or r.usage.prompt_tokens != n_p:
        reflib.fail(f"{what}: {len(ids)} tokens, usage {r.usage}")
    if not ch.text.startswith(prompt):
        reflib.fail(f"{what}: echo text {ch.text!r} does not start with the prompt")
    if lp.token_logprobs[0] is not None or lp.top_logprobs[0] is not None:
        reflib.fail(f"{what}: the first prompt token must have no logprob")
    lsm = lsm_of(ref, ids)
    worst = 0.0
    for i in range(1, len(ids)):
        row = lsm[i - 1]
        worst = max(worst, abs(lp.token_logprobs[i] - row[ids[i]]))
        top = np.argsort(-row, kind="stable")[:3]
        got = {int(k.split(":")[1]): v for k, v in lp.top_logprobs[i].items()}
        for t in top:
            if int(t) not in got:
                # a near-tie at the edge of the top 3 may order differently; it must then be a tie
                third = sorted(row, reverse=True)[2]
                if abs(row[t] - third) > TOL:
                    reflib.fail(f"{what}: position {i}: top token {t} missing from {got}")
                continue
            worst = max(worst, abs(got[int(t)] - row[t]))
        if i >= n_p and ids[i] != int(np.argmax(row)) and row.max() - row[ids[i]] > TOL:
            reflib.fail(f"{what}: greedy token {ids[i]} at {i} is not the argmax {int(np.argmax(row))}")
    if worst > TOL:
        reflib.fail(f"{what}: logprobs differ from transformers by {worst:.2e} > {TOL}")
    return worst, r


PROMPT = "The little robot looked at the stars and said"
worst_all = 0.0
for name, ref in [("base", ref_base), ("a1", ref_a1), ("a2", ref_a2)]:
    w, _ = check_echo(name, ref, PROMPT, 10, f"echo {name}")
    worst_all = max(worst_all, w)
    w, r0 = check_echo(name, ref, "Once upon a time, in a quiet village by the sea,", 0, f"echo max_tokens=0 {name}")
    worst_all = max(worst_all, w)
    if r0.choices[0].finish_reason != "length" or r0.choices[0].text != "Once upon a time, in a quiet village by the sea,":
        reflib.fail(f"echo max_tokens=0: {r0.choices[0]}")
print(f"ok  echo + logprobs equal transformers+peft for base, a1, a2 (max |diff| {worst_all:.2e}); token ids; max_tokens 0")

# ---- 2. completions ----
base_req = dict(model="a1", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
plain = client.completions.create(**base_req)
text = plain.choices[0].text
if plain.choices[0].finish_reason != "length" or not text or plain.usage.completion_tokens != 16:
    reflib.fail(f"plain completion: {plain}")
chunks = list(client.completions.create(**base_req, stream=True, stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].text for c in chunks if c.choices)
if streamed != text:
    reflib.fail(f"streamed text {streamed!r} != {text!r}")
if chunks[-1].usage is None or chunks[-1].usage.completion_tokens != 16 or chunks[-1].choices:
    reflib.fail(f"include_usage: last chunk {chunks[-1]}")
fins = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
if fins != ["length"]:
    reflib.fail(f"stream finish reasons {fins}")
print(f"ok  streaming: {len(chunks)} chunks add up to the text; usage in the last chunk")

samp = dict(model="a2", prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95, n=4, seed=1234,
            extra_body={"ignore_eos": True, "top_k": 50})
s1 = client.completions.create(**samp)
s2 = client.completions.create(**samp)
if [c.index for c in s1.choices] != [0, 1, 2, 3] or [c.text for c in s1.choices] != [c.text for c in s2.choices]:
    reflib.fail(f"n=4 with a seed is not reproducible: {[c.text for c in s1.choices]} vs {[c.text for c in s2.choices]}")
if len(set(c.text for c in s1.choices)) < 2:
    reflib.fail(f"n=4 sampled samples are all equal: {[c.text for c in s1.choices]}")
if s1.usage.completion_tokens != 48:
    reflib.fail(f"n=4 usage {s1.usage}")
print("ok  n=4 with a seed: 4 choices, reproducible, distinct")

prompts = [PROMPT, "A recipe for bread:"]
batch = client.completions.create(model="a1", prompt=prompts, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
single = [client.completions.create(model="a1", prompt=p, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
if [c.text for c in batch.choices] != single or [c.index for c in batch.choices] != [0, 1]:
    reflib.fail(f"batch prompts {[c.text for c in batch.choices]} != one by one {single}")
ids = enc(PROMPT)
byid = client.completions.create(model="a1", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
if byid.choices[0].text != text:
    reflib.fail(f"token-id prompt {byid.choices[0].text!r} != string prompt {text!r}")
byids = client.completions.create(model="a1", prompt=[ids, ids[:5]], max_tokens=4, temperature=0)
if len(byids.choices) != 2:
    reflib.fail("a list of token-id prompts must give 2 choices")
stop = text[len(text) // 2:len(text) // 2 + 3]
if stop.strip():
    st = client.completions.create(**dict(base_req, stop=[stop]))
    if st.choices[0].finish_reason != "stop" or st.choices[0].text != text[:text.find(stop)]:
        reflib.fail(f"stop {stop!r}: {st.choices[0]}")
print("ok  batch of prompts, token-id prompts, stop strings")

# ---- 3. chat templates ----
templates = {}
for name in ("llama-3.1", "qwen3", "gemma-3-template"):
    with open(os.path.join(reflib.SRCDIR, "tests", "data", "tokenizers", name, "tokenizer_config.json")) as f:
        templates[name] = json.load(f)["chat_template"]
# the other common ones, vendored (tests/test_ref_chat_template.py holds every vendored one to transformers)
for name in ("llama-2-chat", "mistral-7b-instruct-v0.1", "mistral-7b-instruct-v0.2", "chatml", "zephyr",
             "qwen2.5-instruct", "llama-3.1-instruct"):
    with open(os.path.join(reflib.SRCDIR, "tests", "data", "chat_templates", name + ".jinja")) as f:
        templates[name] = f.read()
for need in ("llama-3.1", "qwen3", "gemma-3-template"):
    if need not in templates:
        reflib.fail(f"template {need} missing")

USER = ["Hello!", "What is 2+2?", "Écris un poème sur la mer 🌊", "日本語で答えてください。", "  spaces around  ",
        "line one\nline two\n\nline four", "", "Tell me about {{ braces }} and {% tags %}", "tab\there", "last one"]
ASSIST = ["Hi there.", "4", "La mer est bleue…", "はい。", "", "Sure:\n- a\n- b", " trailing ", "ok"]


def conversations():
    convs = []
    k = 0
    for system in (None, "You are a helpful assistant.", None, "Système: réponds en français ✓"):
        for turns in (1, 2, 3, 4):
            for agp in (True, False):
                msgs = []
                if system is not None:
                    msgs.append({"role": "system", "content": system})
                for t in range(turns):
                    msgs.append({"role": "user", "content": USER[(k + t) % len(USER)]})
                    if t < turns - 1 or not agp:
                        msgs.append({"role": "assistant", "content": ASSIST[(k + t) % len(ASSIST)]})
                k += 1
                convs.append((msgs, agp))
    convs.append(([{"role": "user", "content": [{"type": "text", "text": "part one"}]}], True))
    convs.append(([{"role": "user", "content": ""}], True))
    convs.append(([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": "z"}], False))
    convs.append(([{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}], True))
    convs.append(([{"role": "user", "content": "🙂" * 20}], True))
    convs.append(([{"role": "user", "content": "a\u00a0b\u2028c"}], True))
    return convs


def hf_render(tmpl, msgs, agp, tok=None):
    tok = tok or hf_tok
    hmsgs = []
    for m in msgs:  # the server joins text parts into a string for templates that read strings
        c = m["content"]
        if isinstance(c, list) and "['type']" not in tmpl and '["type"]' not in tmpl:
            c = "\n".join(p["text"] for p in c)
        hmsgs.append(dict(m, content=c))
    try:
        return tok.apply_chat_template(hmsgs, chat_template=tmpl, tokenize=False, add_generation_prompt=agp)
    except Exception as e:  # noqa: BLE001 (the template's own raise_exception)
        return e


def server_tokens(s, msgs, agp, tmpl=None, headers=AUTH):
    body = {"messages": msgs, "add_generation_prompt": agp}
    if tmpl is not None:
        body["chat_template"] = tmpl
    return s.request("POST", "/tokenize", body, headers=headers)


n_checked = {}
for tname, tmpl in templates.items():
    n = 0
    for msgs, agp in conversations():
        want = hf_render(tmpl, msgs, agp)
        st, got, _ = server_tokens(srv, msgs, agp, tmpl)
        if isinstance(want, Exception):
            if st != 400:
                reflib.fail(f"{tname}: transformers raised {want!r} but the server answered {st} {got}")
            continue
        want_ids = enc(want, False)
        if st != 200 or got["tokens"] != want_ids:
            reflib.fail(f"{tname}: {msgs} agp={agp}\nserver {st} {got}\nwant {want!r}\n   = {want_ids}")
        n += 1
    if n < 20:
        reflib.fail(f"{tname}: only {n} conversations rendered (want >= 20)")
    n_checked[tname] = n
print(f"ok  /tokenize with messages equals apply_chat_template: {n_checked}")

# a model's own template, from its tokenizer_config.json (Llama-3.1's tokenizer and template)
l3_dir, _, _ = make_tok_model("llama-3.1", seed=4, hidden=32, layers=1)
l3_tok = transformers.AutoTokenizer.from_pretrained(l3_dir)
l3_raw = Tokenizer.from_file(os.path.join(l3_dir, "tokenizer.json"))
# --profile-cost-model: the cost model is fitted on synthetic batches before the server is ready
srv3 = Server(["--model", l3_dir, "--threads", "2", "--kv-cache-bytes", "16M", "--profile-cost-model", "0.3"])
_, vals3 = srv3.metrics()
if vals3.get("caraserve_cost_model_fitted_steps", 0) < 6 or "caraserve_cost_model_r2" not in vals3:
    reflib.fail(f"--profile-cost-model: fitted steps {vals3.get('caraserve_cost_model_fitted_steps')}, "
                f"R² {vals3.get('caraserve_cost_model_r2')}")
print(f"ok  --profile-cost-model: {int(vals3['caraserve_cost_model_fitted_steps'])} steps fitted before ready, "
      f"R² {vals3['caraserve_cost_model_r2']:.3f}")
n = 0
for msgs, agp in conversations():
    want = hf_render(l3_tok.chat_template, msgs, agp, l3_tok)
    st, got, _ = server_tokens(srv3, msgs, agp, headers={})
    if isinstance(want, Exception):
        if st != 400:
            reflib.fail(f"llama-3.1 own template: transformers raised {want!r}, server {st}")
        continue
    want_ids = l3_raw.encode(want, add_special_tokens=False).ids
    if st != 200 or got["tokens"] != want_ids:
        reflib.fail(f"llama-3.1 own template: {msgs}\nserver {got}\nwant {list(want_ids)}")
    n += 1
l3_client = OpenAI(base_url=srv3.base + "/v1", api_key="unused", max_retries=0, timeout=300)
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
cr = l3_client.chat.completions.create(model=l3_client.models.list().data[0].id, messages=msgs, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
want_ids = l3_raw.encode(hf_render(l3_tok.chat_template, msgs, True, l3_tok), add_special_tokens=False).ids
if cr.usage.prompt_tokens != len(want_ids):
    reflib.fail(f"chat prompt tokens {cr.usage.prompt_tokens} != {len(want_ids)}")
comp3 = l3_client.completions.create(model=cr.model, prompt=want_ids, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
if cr.choices[0].message.content != comp3.choices[0].text:
    reflib.fail(f"chat {cr.choices[0].message.content!r} != completion of apply_chat_template's ids {comp3.choices[0].text!r}")
srv3.stop()
print(f"ok  a model's own Llama-3.1 template: {n} conversations equal; chat generates from that prompt")

# chat completions on the main server with a request template (ChatML-like from the vendored set)
tmpl = templates.get("chatml", templates["qwen3"])
msgs = [{"role": "user", "content": "Say something."}]
cc = client.chat.completions.create(model="a2", messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"chat_template": tmpl, "ignore_eos": True})
rendered = hf_render(tmpl, msgs, True)
prompt_ids = enc(rendered, False)
comp = client.completions.create(model="a2", prompt=prompt_ids, max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True})
if cc.choices[0].message.content != comp.choices[0].text or cc.usage.prompt_tokens != len(prompt_ids):
    reflib.fail(f"chat {cc.choices[0].message.content!r} != completion of the rendered prompt {comp.choices[0].text!r}")
if len(cc.choices[0].logprobs.content) != 10 or len(cc.choices[0].logprobs.content[0].top_logprobs) != 2:
    reflib.fail(f"chat logprobs: {cc.choices[0].logprobs}")
stream = client.chat.completions.create(model="a2", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                        extra_body={"chat_template": tmpl, "ignore_eos": True})
parts = []
roles = []
for ch in stream:
    if ch.choices:
        if ch.choices[0].delta.role:
            roles.append(ch.choices[0].delta.role)
        parts.append(ch.choices[0].delta.content or "")
if "".join(parts) != cc.choices[0].message.content or roles != ["assistant"]:
    reflib.fail(f"chat stream {''.join(parts)!r} roles {roles} != {cc.choices[0].message.content!r}")
print("ok  chat completions (streamed and not) generate from the rendered prompt; chat logprobs")

# ---- 4. models, tokenize, adapters over HTTP, metrics ----
ml = client.models.list()
ids_ = {m.id: m for m in ml.data}
if set(ids_) != {"base", "a1", "a2"} or ids_["a1"].parent != "base" or ids_["base"].parent is not None:
    reflib.fail(f"/v1/models: {ml}")
st, tk, _ = srv.request("POST", "/tokenize", {"prompt": PROMPT}, headers=AUTH)
if st != 200 or tk["tokens"] != enc(PROMPT) or tk["count"] != len(tk["tokens"]):
    reflib.fail(f"/tokenize: {st} {tk}")
st, dt, _ = srv.request("POST", "/detokenize", {"tokens": tk["tokens"]}, headers=AUTH)
if st != 200 or dt["prompt"] != raw_tok.decode(tk["tokens"], skip_special_tokens=False):
    reflib.fail(f"/detokenize: {st} {dt} != {raw_tok.decode(tk['tokens'], skip_special_tokens=False)!r}")

st, body, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": os.path.join(root, "a3")},
                          headers=AUTH)
if st != 200:
    reflib.fail(f"load_lora_adapter: {st} {body}")
if "a3" not in {m.id for m in client.models.list().data}:
    reflib.fail("a3 not listed after loading")
check_echo("a3", ref_a3, PROMPT, 4, "adapter loaded over HTTP")
st, body, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": os.path.join(root, "a3b")},
                          headers=AUTH)
if st != 400:
    reflib.fail(f"loading an existing name without load_inplace must be 400, got {st} {body}")
st, body, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": os.path.join(root, "a3b"),
                                                            "load_inplace": True}, headers=AUTH)
if st != 200:
    reflib.fail(f"load_inplace: {st} {body}")
check_echo("a3", ref_a3b, PROMPT, 4, "adapter replaced in place")
st, body, _ = srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "a3"}, headers=AUTH)
if st != 200:
    reflib.fail(f"unload: {st} {body}")
st, body, _ = srv.request("POST", "/v1/completions", {"model": "a3", "prompt": "x", "max_tokens": 1}, headers=AUTH)
if st != 404 or "error" not in body:
    reflib.fail(f"a request for an unloaded adapter: {st} {body}")
print("ok  /v1/models, /tokenize, /detokenize; load, load_inplace (new weights for new requests), unload")

# requests with SLOs of their own are counted, and whether they met them: one surely met, one
# whose TPOT bound no two tokens can meet
for slo in ({"ttft_ms": 600000, "tpot_ms": 600000}, {"tpot_ms": 1e-6}):
    st, body, _ = srv.request("POST", "/v1/completions", {"model": "a1", "prompt": PROMPT, "max_tokens": 4,
                                                          "ignore_eos": True, "slo": slo}, headers=AUTH)
    if st != 200:
        reflib.fail(f"a request with slo {slo}: {st} {body}")
txt, vals = srv.metrics()
slo_req = 'caraserve_slo_requests_total{adapter="a1",rank="8"}'
slo_met = 'caraserve_slo_attained_total{adapter="a1",rank="8"}'
if vals.get(slo_req) != 2 or vals.get(slo_met) != 1:
    reflib.fail(f"/metrics: SLO requests {vals.get(slo_req)}, attained {vals.get(slo_met)} (want 2 and 1):\n{txt}")
print("ok  requests with an slo are counted by adapter and rank, and whether they met it")
for k in ("caraserve_adapter_time_to_first_token_seconds_count{adapter=\"a1\"}", "caraserve_time_to_first_token_seconds_count", "caraserve_generation_tokens_total{adapter=\"a2\"}",
          "caraserve_num_requests_running", "caraserve_kv_cache_usage_perc", "caraserve_prefix_cache_queries_total",
          "caraserve_lora_adapters{tier=\"registered\"}", "caraserve_cost_model_r2", "caraserve_cost_model_coefficient_seconds{term=\"prefill_tokens\"}"):
    if k not in vals:
        reflib.fail(f"/metrics lacks {k}:\n{txt}")
dev_key = "caraserve_lora_adapters{tier=\"device\"}"
if vals.get(dev_key, 0) < 2:  # a1 and a2 ran: their slots stay (no bound)
    reflib.fail(f"/metrics: adapters in device slots {vals.get(dev_key)}:\n{txt}")
# loads per adapter: GET /v1/adapters/NAME/stats (/metrics has their total)
# (a3 is unloaded by now: its counts stay)
loads = {}
for name in ("a1", "a2", "a3"):
    st, one, _ = srv.request("GET", f"/v1/adapters/{name}/stats", headers=AUTH)
    if st != 200:
        reflib.fail(f"GET /v1/adapters/{name}/stats: {st} {one}")
    if one["loads"]["from_disk"]:
        loads[name] = one["loads"]["from_disk"]
if (len(loads) < 3 or sum(loads.values()) < 3 or vals["caraserve_prefix_cache_hits_total"] <= 0
        or vals.get("caraserve_lora_load_seconds_count") != sum(loads.values())):
    reflib.fail(f"loads per adapter {loads} (/metrics: {vals.get('caraserve_lora_load_seconds_count')} in all), "
                f"prefix hits {vals['caraserve_prefix_cache_hits_total']}")
# every load counted once by how it was read: O_DIRECT where the file system takes it
try:
    os.close(os.open(os.path.join(a1_dir, "adapter_model.safetensors"), os.O_RDONLY | os.O_DIRECT))
    fs_direct = True
except OSError:
    fs_direct = False
by_io = {io: vals.get(f'caraserve_lora_loads_total{{io="{io}"}}', -1) for io in ("direct", "buffered")}
if by_io["direct"] + by_io["buffered"] != sum(loads.values()) or by_io["buffered" if fs_direct else "direct"] != 0:
    reflib.fail(f"/metrics: loads by io {by_io} against {sum(loads.values())} loads (O_DIRECT here: {fs_direct})")
print(f"ok  /metrics counts {int(sum(loads.values()))} adapter loads by how they were read: {by_io}")
if shutil.which("promtool"):
    p = subprocess.run(["promtool", "check", "metrics"], input=txt, capture_output=True, text=True)
    if p.returncode != 0 or p.stdout.strip() or p.stderr.strip():
        reflib.fail(f"promtool check metrics: exit {p.returncode}\n{p.stdout}{p.stderr}")
    print("ok  /metrics passes promtool check metrics")
else:
    print("note: promtool not installed; /metrics format not linted")
rc = srv.stop()
if rc != 0:
    reflib.fail(f"server exit {rc} after SIGTERM")
print("ok  SIGTERM: exit 0")
