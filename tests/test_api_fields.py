"""test_api_fields.py: every request field OpenAI, vLLM and SGLang define is honoured or refused,
none dropped. The inventory is `caraserve fields --json` (the table the routes read):

- each honoured field's bad value is a 400 naming the field (so a parser that stops reading it
  fails here), each refused field's value a 400 naming it, each neutral value of a refused
  field a 200; docs/api-fields.md is `caraserve fields` to the byte;
- the honoured fields behave, against transformers + peft (float32, CPU) on a random-weight
  Llama with a real tokenizer: prompt_logprobs (values, ranks, alternatives) on the base model
  and an adapter; logit_bias (-100 never sampled, +100 always; the raw logprobs unchanged) and
  allowed_token_ids (greedy = the argmax over the allowed ids); continue_final_message against
  apply_chat_template; echo with special tokens; top_logprobs in vLLM's order;
- the official openai client: models.retrieve, streamed usage with continuous_usage_stats,
  prompt_logprobs through extra_body, logit_bias, without errors."""
import copy
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers

import reflib

sys.path.insert(0, os.path.dirname(__file__))
from hfmodels import make_adapter  # noqa: E402
from openai import OpenAI  # noqa: E402
from serverlib import Server, make_tok_model, set_chat_template  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4

out = subprocess.run([reflib.CARASERVE, "fields", "--json"], capture_output=True, text=True, check=True).stdout
FIELDS = json.loads(out)
md = subprocess.run([reflib.CARASERVE, "fields"], capture_output=True, text=True, check=True).stdout
with open(os.path.join(reflib.SRCDIR, "docs", "api-fields.md")) as f:
    if f.read() != md:
        reflib.fail("docs/api-fields.md is not `caraserve fields`: regenerate it with `caraserve fields > docs/api-fields.md`")

model_dir, ref_base, tokdir = make_tok_model("spm-32k", seed=5)
set_chat_template(model_dir, "chatml")
hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
a1_dir, ref_a1 = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=21)
a2_dir, _ = make_adapter(model_dir, ref_base, r=4, alpha=8, targets=["q_proj"], seed=22)
a3_dir, _ = make_adapter(model_dir, ref_base, r=16, alpha=8, targets=["q_proj"], seed=23)
root = reflib.tmpdir("cs_lora_root_")
shutil.copytree(a2_dir, os.path.join(root, "a2"))
shutil.copytree(a3_dir, os.path.join(root, "a3"))
for bad, change in (("dora", {"use_dora": True}), ("mts", {"modules_to_save": ["lm_head"]}), ("bias", {"bias": "all"})):
    shutil.copytree(a2_dir, os.path.join(root, bad))
    cfgp = os.path.join(root, bad, "adapter_config.json")
    with open(cfgp) as f:
        cfg = json.load(f)
    cfg.update(change)
    with open(cfgp, "w") as f:
        json.dump(cfg, f)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules", f"a1={a1_dir}", "--lora-root", root,
              "--max-lora-rank", "8", "--threads", "2", "--kv-cache-bytes", "64M"])
client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)

MINIMAL = {
    "/v1/completions": {"model": "base", "prompt": "Hello there", "max_tokens": 1},
    "/v1/chat/completions": {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/tokenize": {"model": "base", "prompt": "Hello there"},
    "/detokenize": {"model": "base", "tokens": [1, 15043]},
    "/generate": {"text": "Hello there", "sampling_params": {"max_new_tokens": 1}},
    "/v1/rollout": {"groups": [{"group_id": "g", "input_ids": [1, 15043, 727], "n": 1}], "sampling": {"max_tokens": 1}},
}


# /tokenize takes vLLM's two request forms: a prompt, or chat messages and their template fields
TOKENIZE_CHAT = {"model": "base", "messages": [{"role": "user", "content": "Hi"}]}
CHAT_FORM = {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
             "documents", "tools", "mm_processor_kwargs"}


def minimal(ep, field):
    return TOKENIZE_CHAT if ep == "/tokenize" and field in CHAT_FORM else MINIMAL[ep]


def merged(a, b):
    r = copy.deepcopy(a)
    for k, v in b.items():
        r[k] = merged(r[k], v) if isinstance(v, dict) and isinstance(r.get(k), dict) else v
    return r


def at(path, value):
    """{"a": {"b": value}} for path "a.b" """
    for k in reversed(path.split(".")):
        value = {k: value}
    return value


def names_field(r, name):
    err = r.get("error", {}) if isinstance(r, dict) else {}
    last = name.split(".")[-1]
    return err.get("param") in (name, last) or last in (err.get("message") or "")


for ep, body in MINIMAL.items():
    st, r, _ = srv.request("POST", ep, body)
    if st != 200:
        reflib.fail(f"{ep}: the minimal request {body} answered {st}: {r}")
n_honoured = n_refused = n_neutral = 0
for f in FIELDS:
    for ep in f["endpoints"]:
        if f["honoured"]:
            if f["bad"] is None:
                continue
            body = merged(minimal(ep, f["name"]), f["bad"])
            st, r, _ = srv.request("POST", ep, body)
            if st != 400 or not names_field(r, f["name"]):
                reflib.fail(f"{ep} {f['name']} is honoured, but its bad value {f['bad']} answered {st}: {r} "
                            "(the parser does not read it)")
            n_honoured += 1
        else:
            st, r, _ = srv.request("POST", ep, merged(minimal(ep, f["name"]), at(f["name"], "refused-value")))
            if st != 400 or not names_field(r, f["name"]) or "not supported" not in r["error"]["message"]:
                reflib.fail(f"{ep} {f['name']} is refused, but it answered {st}: {r}")
            n_refused += 1
            for nv in (f["neutral"] or "").split(";"):
                if not nv.strip():
                    continue
                body = merged(minimal(ep, f["name"]), at(f["name"], json.loads(nv)))
                st, r, _ = srv.request("POST", ep, body)
                if st != 200:
                    reflib.fail(f"{ep} {f['name']}: its neutral value {nv} answered {st}: {r}")
                n_neutral += 1
print(f"ok  inventory: {len(FIELDS)} rows; {n_honoured} honoured fields read (their bad values refused by name), "
      f"{n_refused} refused by name, {n_neutral} neutral values accepted")


# ---- prompt_logprobs against transformers (base model and an adapter) ----
def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


prompt_ids = hf_tok("The quick brown fox jumps over the lazy dog").input_ids
K = 3
for name, ref in (("base", ref_base), ("a1", ref_a1)):
    st, r, _ = srv.request("POST", "/v1/completions", {"model": name, "prompt": prompt_ids, "max_tokens": 1,
                                                         "temperature": 0, "prompt_logprobs": K})
    if st != 200:
        reflib.fail(f"prompt_logprobs on {name}: {st} {r}")
    plp = r["choices"][0]["prompt_logprobs"]
    lp = hf_logprobs(ref, prompt_ids)
    if len(plp) != len(prompt_ids) or plp[0] is not None:
        reflib.fail(f"prompt_logprobs on {name}: {len(plp)} entries for {len(prompt_ids)} tokens, first {plp[0]}")
    worst = 0.0
    for t in range(1, len(prompt_ids)):
        row = lp[t - 1]
        entry = plp[t]
        keys = list(entry)
        if keys[0] != str(prompt_ids[t]):
            reflib.fail(f"prompt_logprobs[{t}] on {name}: the prompt's token {prompt_ids[t]} is not first: {keys}")
        tok = entry[keys[0]]
        want = row[prompt_ids[t]].item()
        rank = int((row > row[prompt_ids[t]]).sum().item()) + 1
        if tok["rank"] != rank:
            reflib.fail(f"prompt_logprobs[{t}] on {name}: rank {tok['rank']}, transformers {rank}")
        if tok["decoded_token"] != hf_tok.decode([prompt_ids[t]]) and tok["decoded_token"] != hf_tok.convert_ids_to_tokens(prompt_ids[t]).replace("\u2581", " "):
            reflib.fail(f"prompt_logprobs[{t}] on {name}: decoded_token {tok['decoded_token']!r}")
        worst = max(worst, abs(tok["logprob"] - want))
        top = torch.topk(row, K)
        alts = [k for k in keys[1:]]
        want_alts = [str(i) for i in top.indices.tolist() if i != prompt_ids[t]][:len(alts)]
        if alts != want_alts[:len(alts)] or len(keys) < K:
            reflib.fail(f"prompt_logprobs[{t}] on {name}: alternatives {alts}, transformers {top.indices.tolist()}")
        for k in alts:
            worst = max(worst, abs(entry[k]["logprob"] - row[int(k)].item()))
    if worst > TOL:
        reflib.fail(f"prompt_logprobs on {name}: max |diff| {worst:.2e} against transformers (tolerance {TOL})")
    print(f"ok  prompt_logprobs on {name}: {len(prompt_ids) - 1} positions, ranks and top-{K} as transformers, "
          f"max |diff| {worst:.1e}")

# chat: at the response's top level
st, r, _ = srv.request("POST", "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 1, "prompt_logprobs": 0})
if st != 200 or not isinstance(r.get("prompt_logprobs"), list) or r["prompt_logprobs"][0] is not None:
    reflib.fail(f"chat prompt_logprobs: {st} {str(r)[:300]}")
# streamed: a chunk carries it
st, txt, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": prompt_ids, "max_tokens": 2,
                                                      "prompt_logprobs": 1, "stream": True})
chunks = [json.loads(x[6:]) for x in txt.split("\n\n") if x.startswith("data: {")]
got = [c["choices"][0]["prompt_logprobs"] for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
if len(got) != 1 or len(got[0]) != len(prompt_ids):
    reflib.fail(f"streamed prompt_logprobs: {len(got)} chunks carry it")
st, r, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": -1})
if st != 400 or r["error"]["param"] != "prompt_logprobs":
    reflib.fail(f"prompt_logprobs -1: {st} {r}")
print("ok  prompt_logprobs: chat's at the top level, streamed in a chunk of its own, -1 refused by name")

# ---- logit_bias and allowed_token_ids ----
base_prompt = hf_tok("Once upon a time").input_ids
row = hf_logprobs(ref_base, base_prompt)[-1]
greedy = int(row.argmax())
st, r, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": base_prompt, "max_tokens": 1,
                                                    "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True})
if r["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{greedy}":
    reflib.fail(f"greedy token {r['choices'][0]['logprobs']['tokens']} is not transformers' {greedy}")
body = {"model": "base", "prompt": base_prompt, "max_tokens": 8, "temperature": 1.0, "n": 8, "seed": 1,
        "logit_bias": {str(greedy): -100}, "logprobs": 0, "return_tokens_as_token_ids": True}
st, r, _ = srv.request("POST", "/v1/completions", body)
firsts = {c["logprobs"]["tokens"][0] for c in r["choices"]}
if st != 200 or f"token_id:{greedy}" in firsts:
    reflib.fail(f"logit_bias -100 on {greedy}: {st}, first tokens {firsts}")
raw = r["choices"][0]["logprobs"]["token_logprobs"][0]
tid = int(r["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
if abs(raw - row[tid].item()) > TOL:
    reflib.fail(f"logit_bias changed the raw logprob of {tid}: {raw} vs transformers {row[tid].item()}")
pick = int(torch.argsort(row)[len(row) // 2])  # an unlikely token
body.update(logit_bias={str(pick): 100}, n=4)
st, r, _ = srv.request("POST", "/v1/completions", body)
toks = [t for c in r["choices"] for t in c["logprobs"]["tokens"]]
if st != 200 or set(toks) != {f"token_id:{pick}"}:
    reflib.fail(f"logit_bias +100 on {pick}: {st}, tokens {set(toks)}")
allowed = [int(i) for i in torch.argsort(row)[:5]]  # the five least likely
st, r, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": base_prompt, "max_tokens": 1, "temperature": 0,
                                                    "allowed_token_ids": allowed, "logprobs": 0,
                                                    "return_tokens_as_token_ids": True})
want = max(allowed, key=lambda i: row[i].item())
if st != 200 or r["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{want}":
    reflib.fail(f"allowed_token_ids {allowed}: {st} {r}; transformers' argmax over them is {want}")
for bad, why in (({"logit_bias": {"99999999": 1}}, "out-of-vocab"), ({"logit_bias": {"5": 101}}, "between -100 and 100"),
                 ({"logit_bias": {"x": 1}}, "integer"), ({"allowed_token_ids": [-1]}, "out-of-vocab")):
    st, r, _ = srv.request("POST", "/v1/completions", merged(MINIMAL["/v1/completions"], bad))
    if st != 400 or why not in r["error"]["message"]:
        reflib.fail(f"{bad}: {st} {r}")
print(f"ok  logit_bias: -100 never sampled, +100 always, raw logprobs unchanged; allowed_token_ids greedy = "
      f"transformers' argmax over them; bad ids and biases refused")

# ---- continue_final_message, against apply_chat_template ----
msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is "}]
st, r, _ = srv.request("POST", "/tokenize", {"model": "base", "messages": msgs, "continue_final_message": True,
                                              "add_generation_prompt": False})
want = hf_tok.apply_chat_template(msgs, continue_final_message=True, add_generation_prompt=False, tokenize=False)
want_ids = hf_tok(want, add_special_tokens=False).input_ids
if st != 200 or r["tokens"] != want_ids:
    reflib.fail(f"continue_final_message /tokenize: {st} {r.get('tokens')} vs transformers {want_ids} ({want!r})")
st, r, _ = srv.request("POST", "/v1/chat/completions", {"model": "base", "messages": msgs, "continue_final_message": True,
                                                         "add_generation_prompt": True, "max_tokens": 1})
if st != 400 or r["error"]["param"] != "continue_final_message":
    reflib.fail(f"continue_final_message with add_generation_prompt: {st} {r}")
print("ok  continue_final_message: the prompt is apply_chat_template's; with add_generation_prompt a 400")

# ---- echo of a token-id prompt with special tokens; top_logprobs order ----
ids = [hf_tok.bos_token_id] + hf_tok("Hello").input_ids[1:] + [hf_tok.eos_token_id, hf_tok.bos_token_id]
st, r, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": ids, "max_tokens": 2, "temperature": 0,
                                                    "echo": True, "logprobs": 0})
c = r["choices"][0]
lp = c["logprobs"]
ptext = hf_tok.decode(ids, skip_special_tokens=False)  # vLLM decodes an echoed id prompt as it is
if not c["text"].startswith(ptext) or len(lp["tokens"]) != len(ids) + 2:
    reflib.fail(f"echo: text {c['text']!r} does not start with the prompt's text {ptext!r}")
offs = [0]
for t in lp["tokens"][:len(ids) - 1]:
    offs.append(offs[-1] + len(t))
offs += [len(ptext), len(ptext) + len(lp["tokens"][len(ids)])]
if lp["text_offset"] != offs or lp["top_logprobs"][0] is not None or any(len(d) != 1 for d in lp["top_logprobs"][1:]):
    reflib.fail(f"echo: text_offset {lp['text_offset']} (want {offs}), top_logprobs {lp['top_logprobs']}")
st, r, _ = srv.request("POST", "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 4, "temperature": 1.0, "seed": 3,
                                                         "logprobs": True, "top_logprobs": 3})
for e in r["choices"][0]["logprobs"]["content"]:
    if e["top_logprobs"][0]["token"] != e["token"] or len(e["top_logprobs"]) != 3:
        reflib.fail(f"chat top_logprobs: the chosen token {e['token']!r} is not first: {e['top_logprobs']}")
print("ok  echo keeps special tokens (text, text_offset agree); top_logprobs put the chosen token first")

# ---- /v1/models, model "", the openai client ----
st, r, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": os.path.join(root, "a2")})
if st != 200:
    reflib.fail(f"load a2: {st} {r}")
ids_listed = [m.id for m in client.models.list().data]
if ids_listed != ["base", "a1", "a2"]:
    reflib.fail(f"/v1/models lists {ids_listed}, not the registration order")
m = client.models.retrieve("a2")
if m.id != "a2" or getattr(m, "parent", None) != "base":
    reflib.fail(f"models.retrieve('a2'): {m}")
st, r, _ = srv.request("GET", "/v1/models/nope")
if st != 404:
    reflib.fail(f"/v1/models/nope: {st}")
st, r, _ = srv.request("POST", "/v1/completions", merged(MINIMAL["/v1/completions"], {"model": ""}))
if st != 200:
    reflib.fail(f"model \"\": {st} {r}")
stream = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
chunks = list(stream)
for i, ch in enumerate(chunks):
    if ch.usage is None:
        reflib.fail(f"continuous_usage_stats: chunk {i} has no usage")
    if ch.choices and ch.choices[0].delta.reasoning_content is not None:
        reflib.fail("reasoning_content is not null")
last = chunks[-1].usage
if last.completion_tokens != sum(1 for c in chunks if c.choices and c.choices[0].delta.content) and last.completion_tokens < 1:
    reflib.fail(f"usage {last}")
comp = client.completions.create(model="a1", prompt="Hello there", max_tokens=2, logit_bias={str(greedy): -100},
                                  extra_body={"prompt_logprobs": 2})
if comp.choices[0].prompt_logprobs is None:
    reflib.fail("prompt_logprobs through extra_body: missing")
print("ok  /v1/models in registration order, models.retrieve, model \"\"; openai client: continuous usage, "
      "reasoning_content, prompt_logprobs via extra_body, logit_bias")
# ---- errors in vLLM's words ----
WORDS = [
    ("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": os.path.join(root, "a3")},
     "LoRA rank 16 is greater than max_lora_rank 8."),
    ("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": os.path.join(root, "dora")}, "does not yet support DoRA"),
    ("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": os.path.join(root, "mts")},
     "only supports modules_to_save being None"),
    ("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": os.path.join(root, "bias")}, "Adapter bias cannot be used"),
    ("/v1/completions", {"model": "base", "prompt": []}, "The decoder prompt cannot be empty"),
    ("/v1/completions", {"model": "base", "prompt": [1, 10 ** 7]}, "Token id 10000000 is out of vocabulary"),
    ("/v1/completions", {"model": "base", "prompt": "x", "seed": 1e19},
     "Input should be less than or equal to 9223372036854775807"),
]
for ep, body, words in WORDS:
    st, r, _ = srv.request("POST", ep, body)
    if st != 400 or words not in r["error"]["message"]:
        reflib.fail(f"{ep} {body}: {st} {r}; vLLM says {words!r}")
print(f"ok  {len(WORDS)} errors in vLLM's words (LoRA rank, DoRA, modules_to_save, bias, empty prompt, "
      "out-of-vocabulary id, seed)")
srv.stop()
print("PASS")
