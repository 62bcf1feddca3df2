"""test_beam_search.py: vLLM's beam search (use_beam_search, n beams, length_penalty) against
transformers (float32, CPU) on a random-weight Llama with a real tokenizer, base model and a
peft adapter:

- without EOS (ignore_eos), the n beams equal transformers' generate(num_beams=n,
  num_return_sequences=n) token for token and in order, and every token's logprob equals
  transformers' teacher-forced log_softmax;
- with EOS ids the model often ranks high, and length penalties 0.5, 1 and 2, the beams, their
  finish reasons and logprobs equal vLLM's algorithm (its serving beam_search: 2n candidates
  per beam, EOS ends a beam, the rest ranked by cum_logprob, the end ranked by cum_logprob /
  len^length_penalty) run on transformers' logits;
- streamed equals not streamed; chat takes it; the openai client sends it through extra_body;
  what a search cannot apply (stop, logit_bias, penalties, n > 10, length_penalty alone) is a
  400 naming the field."""
import json
import os

import torch
import transformers

import reflib
from hfmodels import make_adapter
from openai import OpenAI
from serverlib import Server, make_tok_model, set_chat_template

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
TOL = 1e-4
T = 8

model_dir, ref_base, tokdir = make_tok_model("spm-32k", seed=11, tied=False)
set_chat_template(model_dir, "chatml")
hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
a1_dir, ref_a1 = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=31)
ref_a1.eval()
PROMPTS = [hf_tok("The quick brown fox").input_ids, hf_tok("Once upon a time, in a land").input_ids]


@torch.no_grad()
def last_lsm(model, ids):
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


# EOS ids the model often puts among its top candidates: the token most often in the top 8
# along greedy continuations of the prompts, with the tokenizer's own
counts = {}
for p in PROMPTS:
    ids = list(p)
    for _ in range(T):
        lsm = last_lsm(ref_base, ids)
        for t in torch.topk(lsm, 8).indices.tolist():
            counts[t] = counts.get(t, 0) + 1
        ids.append(int(torch.argmax(lsm)))
EOS = [hf_tok.eos_token_id, max((t for t in counts if t != hf_tok.eos_token_id), key=lambda t: counts[t])]
with open(os.path.join(model_dir, "generation_config.json")) as f:
    gc = json.load(f)
gc["eos_token_id"] = EOS
with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
    json.dump(gc, f)

srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules", f"a1={a1_dir}", "--threads", "2",
              "--kv-cache-bytes", "64M", "--return-tokens-as-token-ids"])
client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)


def ids_of(lp):
    return [int(t.split(":")[1]) for t in lp["tokens"]]


def beams(model, prompt, n, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": T, "n": n, "use_beam_search": True, "logprobs": 0}
    body.update(extra)
    st, r, _ = srv.request("POST", "/v1/completions", body)
    if st != 200:
        reflib.fail(f"beam search {body}: {st} {r}")
    return r["choices"]


def check_logprobs(ref, prompt, toks, lps, what):
    for i, (t, lp) in enumerate(zip(toks, lps)):
        want = float(last_lsm(ref, prompt + toks[:i])[t])
        if abs(want - lp) > TOL:
            reflib.fail(f"{what}: token {i} ({t}) logprob {lp} vs transformers {want}")


# ---- without EOS: transformers' own beam search ----
n_checked = 0
for name, ref in (("base", ref_base), ("a1", ref_a1)):
    ref.generation_config.eos_token_id = None
    for p in PROMPTS:
        for n in (1, 2, 4):
            with torch.no_grad():
                out = ref.generate(torch.tensor([p]), num_beams=n, num_return_sequences=n, max_new_tokens=T,
                                   do_sample=False, early_stopping=False, length_penalty=1.0, pad_token_id=0,
                                   eos_token_id=None, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            want = [row[len(p):].tolist() for row in out]
            got = beams(name, p, n, ignore_eos=True)
            for i, c in enumerate(got):
                toks = ids_of(c["logprobs"])
                if toks != want[i]:
                    reflib.fail(f"{name} n={n} prompt {p}: beam {i} {toks} vs transformers {want[i]}")
                if c["finish_reason"] != "length":
                    reflib.fail(f"{name}: beam {i} finished {c['finish_reason']}, not length")
                check_logprobs(ref, p, toks, c["logprobs"]["token_logprobs"], f"{name} n={n} beam {i}")
                n_checked += 1
print(f"no EOS: {n_checked} beams equal transformers' generate(num_beams)")


# ---- with EOS and length penalties: vLLM's algorithm on transformers' logits ----
def vllm_beam_search(ref, prompt, n, lpen):
    def score(b):
        return b[1] / ((len(prompt) + len(b[0])) ** lpen)

    live = [([], 0.0, [], "length")]
    done = []
    for _ in range(T):
        cands = []
        for toks, cum, lps, _ in live:
            top = torch.topk(last_lsm(ref, prompt + toks), 2 * n)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                if t in EOS:
                    done.append((toks, cum + lp, lps, "stop"))
                else:
                    cands.append((toks + [t], cum + lp, lps + [lp], "length"))
        live = sorted(cands, key=score, reverse=True)[:n]
    return sorted(done + live, key=score, reverse=True)[:n]


n_stop = 0
for name, ref in (("base", ref_base), ("a1", ref_a1)):
    for p in PROMPTS:
        for n, lpen in ((2, 1.0), (3, 0.5), (4, 2.0)):
            want = vllm_beam_search(ref, p, n, lpen)
            got = beams(name, p, n, length_penalty=lpen)
            if len(got) != len(want):
                reflib.fail(f"{name}: {len(got)} beams, the algorithm gives {len(want)}")
            for i, (c, w) in enumerate(zip(got, want)):
                toks = ids_of(c["logprobs"])
                if toks != w[0] or c["finish_reason"] != w[3]:
                    reflib.fail(f"{name} n={n} length_penalty={lpen} prompt {p}: beam {i} {toks} "
                                f"({c['finish_reason']}) vs {w[0]} ({w[3]})")
                for k, (a, b) in enumerate(zip(c["logprobs"]["token_logprobs"], w[2])):
                    if abs(a - b) > TOL:
                        reflib.fail(f"{name} beam {i} token {k}: logprob {a} vs {b}")
                n_stop += c["finish_reason"] == "stop"
if n_stop == 0:
    reflib.fail(f"no beam ended with EOS {EOS}: the EOS path went untested")
print(f"EOS {EOS}: beams equal vLLM's algorithm on transformers' logits ({n_stop} ended by EOS)")

# ---- streamed, chat, the openai client ----
p = PROMPTS[1]
plain = beams("base", p, 3, length_penalty=0.5)
st, raw, _ = srv.request("POST", "/v1/completions", {"model": "base", "prompt": p, "max_tokens": T, "n": 3,
                                                    "use_beam_search": True, "length_penalty": 0.5, "stream": True})
texts = ["", "", ""]
fins = [None] * 3
for line in raw.splitlines():
    if line.startswith("data: {"):
        for c in json.loads(line[6:])["choices"]:
            texts[c["index"]] += c["text"]
            fins[c["index"]] = c["finish_reason"] or fins[c["index"]]
if texts != [c["text"] for c in plain] or fins != [c["finish_reason"] for c in plain]:
    reflib.fail(f"streamed {texts} {fins} vs {[c['text'] for c in plain]}")
cc = client.completions.create(model="a1", prompt=p, max_tokens=T, n=2, extra_body={"use_beam_search": True})
if len(cc.choices) != 2 or not cc.choices[0].text:
    reflib.fail(f"openai client: {cc}")
ch = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
                                    extra_body={"use_beam_search": True})
if len(ch.choices) != 2 or ch.choices[0].message.content is None:
    reflib.fail(f"chat: {ch}")
print("streamed equals not streamed; chat and the openai client take it")

# ---- refused ----
for extra, field in (({"stop": ["x"]}, "stop"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                     ({"presence_penalty": 0.5}, "presence_penalty"), ({"min_tokens": 2}, "min_tokens"),
                     ({"n": 11}, "n"), ({"use_beam_search": False, "length_penalty": 2}, "length_penalty"),
                     ({"length_penalty": "x"}, "length_penalty")):
    body = {"model": "base", "prompt": "Hi", "max_tokens": 2, "use_beam_search": True}
    body.update(extra)
    st, r, _ = srv.request("POST", "/v1/completions", body)
    if st != 400 or field not in json.dumps(r):
        reflib.fail(f"{extra}: {st} {r} (want a 400 naming {field})")
print("what a beam search cannot apply is refused by name")
srv.stop()
print("PASS")
