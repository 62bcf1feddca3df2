"""test_tools.py: tool calls on chat completions for the three template families we ship,
Hermes/Qwen2.5 (<tool_call>), Llama 3.1 (JSON, "parameters") and Mistral ([TOOL_CALLS]).

A random-weight model cannot be relied on to call a tool, so each reply is forced into the
family's call format with guided_grammar (the parser does not know that): the response then
carries message.tool_calls (ids, names, arguments as JSON text), content null (or the text
before the call), finish_reason "tool_calls"; streamed, the deltas rebuild the same calls as
the openai client accumulates them; parallel_tool_calls false keeps the first; tool_choice
none leaves the text as content. The second turn (the assistant's tool_calls with arguments
as JSON text, then the tool's answer) renders to the token ids transformers'
apply_chat_template gives (arguments as the object, as vLLM hands them to templates)."""
import json
import os
import re

import reflib
import transformers
from openai import OpenAI
from serverlib import Server, make_tok_model, set_chat_template

transformers.utils.logging.disable_progress_bar()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CITY = r'[A-Z] [a-z]{2,6}'.replace(" ", "")

FAMILIES = [
    ("hermes", "spm-32k", "qwen2.5-instruct",
     'root ::= "Checking.\\n" call call\ncall ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
     '{\\"city\\": \\"" city "\\"}}\\n</tool_call>\\n"\ncity ::= ' + '[A-Z] [a-z]{2,6}\n', "Checking.\n", 2),
    ("llama3_json", "llama-3.1", "llama-3.1-instruct",
     'root ::= "{\\"name\\": \\"get_weather\\", \\"parameters\\": {\\"city\\": \\"" [A-Z] [a-z]{2,6} "\\"}}"\n',
     None, 1),
    ("mistral", "spm-32k", "mistral-v3-tools",
     'root ::= "[TOOL_CALLS] [{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" [A-Z] [a-z]{2,6} '
     '"\\"}}, {\\"name\\": \\"get_time\\", \\"arguments\\": {}}]"\n', None, 2),
]

for parser, tokname, template, grammar, content, n_calls in FAMILIES:
    model_dir, _, _ = make_tok_model(tokname, seed=9)
    set_chat_template(model_dir, template)
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    srv = Server(["--model", model_dir, "--served-model-name", "m", "--threads", "2", "--kv-cache-bytes", "64M"])
    client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, seed=1,
                                       extra_body={"guided_grammar": grammar})
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    if ch.finish_reason != "tool_calls" or len(calls) != n_calls or ch.message.content != content:
        reflib.fail(f"{parser}: {r}")
    for c in calls:
        if not (c.id.startswith("call_") or (parser == "mistral" and len(c.id) == 9 and c.id.isalnum())) or \
                c.type != "function" or c.function.name not in ("get_weather", "get_time"):
            reflib.fail(f"{parser}: call {c}")
    args = json.loads(calls[0].function.arguments)
    if set(args) != {"city"} or not args["city"][:1].isupper():
        reflib.fail(f"{parser}: arguments {calls[0].function.arguments!r}")
    if len({c.id for c in calls}) != len(calls):
        reflib.fail(f"{parser}: call ids repeat: {calls}")

    # streamed: the deltas rebuild the same calls
    stream = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, seed=1, stream=True,
                                            extra_body={"guided_grammar": grammar})
    got, text, finish = {}, "", None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            text += d.content or ""
            for tc in d.tool_calls or []:
                e = got.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                e["id"] = tc.id or e["id"]
                if tc.function:
                    e["name"] += tc.function.name or ""
                    e["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    want = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    ids = [got[k].pop("id") for k in sorted(got)]
    if [got[k] for k in sorted(got)] != want or finish != "tool_calls" or text != (content or "") or \
            len(set(ids)) != len(ids) or not all(i and (i.startswith("call_") or len(i) == 9) for i in ids):
        reflib.fail(f"{parser} streamed: {got} {text!r} {finish} vs {want}")

    # parallel_tool_calls false: the first only; tool_choice none: the text as content
    if n_calls > 1:
        r1 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, seed=1,
                                            parallel_tool_calls=False, extra_body={"guided_grammar": grammar})
        if len(r1.choices[0].message.tool_calls or []) != 1:
            reflib.fail(f"{parser}: parallel_tool_calls false: {r1}")
    rn = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=300, seed=1, tool_choice="none",
                                        extra_body={"guided_grammar": grammar})
    if rn.choices[0].message.tool_calls or rn.choices[0].finish_reason != "stop" or not rn.choices[0].message.content:
        reflib.fail(f"{parser}: tool_choice none: {rn}")

    # the second turn, through the template, as transformers renders it
    turn = msgs + [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
                   {"role": "tool", "tool_call_id": calls[0].id, "content": "{\"temp_c\": 21}"}]
    st, tk, _ = srv.request("POST", "/tokenize", {"model": "m", "messages": turn, "tools": TOOLS,
                                                 "add_generation_prompt": True})
    hf_turn = json.loads(json.dumps(turn))
    hf_turn[1]["tool_calls"][0]["function"]["arguments"] = args
    want_ids = hf_tok.apply_chat_template(hf_turn, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    if hasattr(want_ids, "input_ids"):
        want_ids = want_ids["input_ids"]
    if st != 200 or tk["tokens"] != list(want_ids):
        reflib.fail(f"{parser}: the second turn renders differently: {st} {tk} vs {list(want_ids)}")
    r2 = client.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=5)
    if not r2.choices:
        reflib.fail(f"{parser}: second turn: {r2}")
    print(f"ok  {parser}: {n_calls} call(s) parsed, streamed alike, second turn rendered as transformers does")
    srv.stop()
# --reasoning-parser: the thinking is reasoning_content and the grammar applies after </think>
for mode, template in (("deepseek_r1", "deepseek-r1-distill-qwen"), ("qwen3", "qwen2.5-instruct")):
    model_dir, _, _ = make_tok_model("qwen3", seed=9)
    set_chat_template(model_dir, template)
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    end_id = hf_tok.convert_tokens_to_ids("</think>")
    srv = Server(["--model", model_dir, "--served-model-name", "m", "--threads", "2", "--kv-cache-bytes", "64M",
                  "--reasoning-parser", mode])
    client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Pick a word."}]
    # thinking that never ends: all reasoning (deepseek_r1 starts inside it; qwen3 only after <think>)
    bias = {str(hf_tok.convert_tokens_to_ids("<think>")): 100} if mode == "qwen3" else {}
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=6, seed=3, logit_bias=bias,
                                       extra_body={"guided_grammar": 'root ::= [a-z]{3,5}\n'})
    m = r.choices[0].message
    if m.content is not None or not getattr(m, "reasoning_content", None) or r.choices[0].finish_reason != "length":
        reflib.fail(f"{mode}: unfinished thinking: {r}")
    # </think> forced at once: the content then follows the grammar, streamed alike
    force = {str(end_id): 100}
    if mode == "qwen3":
        force[str(hf_tok.convert_tokens_to_ids("<think>"))] = 100  # <think> first, then </think> (both biased)
    body = dict(model="m", messages=msgs, max_tokens=40, seed=3, logit_bias=force,
                extra_body={"guided_grammar": 'root ::= [a-z]{3,5} "."\n'})
    r = client.chat.completions.create(**body)
    m = r.choices[0].message
    if not re.fullmatch(r"[a-z]{3,5}\.", m.content or "") or r.choices[0].finish_reason != "stop":
        reflib.fail(f"{mode}: content after </think> does not follow the grammar: {r}")
    rs, cs = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            rs += getattr(c.delta, "reasoning_content", None) or ""
            cs += c.delta.content or ""
    if cs != m.content or rs != (getattr(m, "reasoning_content", None) or ""):
        reflib.fail(f"{mode}: streamed {rs!r} {cs!r} vs {m}")
    print(f"ok  --reasoning-parser {mode}: reasoning_content, the grammar after </think>, streamed alike")
    srv.stop()

# tool_choice "required" and a named function: the reply is constrained to calls (vLLM's way)
import jsonschema  # noqa: E402

BOOK = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS2 = [{"type": "function", "function": {"name": "book", "parameters": BOOK}},
          {"type": "function", "function": {"name": "cancel", "parameters": {
              "type": "object", "properties": {"ref": {"type": "string", "pattern": "[A-Z]{3}[0-9]{2}"}},
              "required": ["ref"], "additionalProperties": False}}}]
model_dir, _, _ = make_tok_model("spm-32k", seed=9)
set_chat_template(model_dir, "qwen2.5-instruct")
srv = Server(["--model", model_dir, "--served-model-name", "m", "--threads", "2", "--kv-cache-bytes", "64M"])
client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
msgs = [{"role": "user", "content": "Book Rome for 3 days."}]
params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS2}
for seed in range(3):
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS2, max_tokens=300, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "book"}})
    ch = r.choices[0]
    if ch.finish_reason != "stop" or len(ch.message.tool_calls or []) != 1 or ch.message.tool_calls[0].function.name != "book":
        reflib.fail(f"named tool_choice: {r}")
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), BOOK)
    for parallel in (True, False):
        r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS2, max_tokens=400, seed=seed,
                                           tool_choice="required", parallel_tool_calls=parallel)
        ch = r.choices[0]
        calls = ch.message.tool_calls or []
        if ch.finish_reason != "tool_calls" or not calls or (not parallel and len(calls) != 1):
            reflib.fail(f"tool_choice required (parallel {parallel}): {r}")
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
stream = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS2, max_tokens=400, seed=1, stream=True,
                                        tool_choice="required")
names = {}
for chunk in stream:
    for c in chunk.choices:
        for tc in c.delta.tool_calls or []:
            names.setdefault(tc.index, [None, ""])
            if tc.function and tc.function.name:
                names[tc.index][0] = tc.function.name
            if tc.function and tc.function.arguments:
                names[tc.index][1] += tc.function.arguments
if not names or any(n not in params for n, _ in names.values()):
    reflib.fail(f"tool_choice required streamed: {names}")
for n, a in names.values():
    jsonschema.validate(json.loads(a), params[n])
st, r, _ = srv.request("POST", "/v1/chat/completions", {"model": "m", "messages": msgs, "tools": TOOLS2,
                                                        "tool_choice": {"type": "function", "function": {"name": "x"}}})
if st != 400 or "has not been passed" not in r["error"]["message"]:
    reflib.fail(f"unknown named tool: {st} {r}")
print("ok  tool_choice required and named: constrained calls valid against the tools' schemas, streamed too")

# An agent loop on /v1/rollout, as veRL's runs one: the chat rendered once to ids, the model's
# turn (forced into a call) parsed by the server ("tool_calls": true), the tool's answer
# appended as tokens, the next turn continued from the ids without re-tokenizing; the response
# marks which tokens the model made (response_mask 1) and which the environment added (0).
import torch  # noqa: E402
torch.set_num_threads(2)
ref = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
st, tk, _ = srv.request("POST", "/tokenize", {"model": "m", "messages": msgs, "tools": TOOLS2})
P = tk["tokens"]
force = 'root ::= "<tool_call>\\n{\\"name\\": \\"book\\", \\"arguments\\": {\\"city\\": \\"Rome\\", \\"days\\": 3}}\\n</tool_call>"\n'
samp = {"max_tokens": 200, "temperature": 0, "logprobs": True}
st, t1, _ = srv.request("POST", "/v1/rollout", {"tool_calls": True, "sampling": samp, "structured_outputs": {"grammar": force},
                                                "groups": [{"input_ids": P}]})
s1 = t1["groups"][0]["samples"][0] if st == 200 else {}
if st != 200 or s1["tool_calls"] != [{"name": "book", "arguments": {"city": "Rome", "days": 3}}]:
    reflib.fail(f"turn 1 with tool_calls: {st} {t1}")
O1, L1 = s1["output_ids"], s1["logprobs"]
E1 = hf_tok.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"booked\": true}\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n", add_special_tokens=False)
turn2 = {"sampling": {"max_tokens": 12, "temperature": 0, "logprobs": True, "ignore_eos": True},
         "groups": [{"input_ids": P, "turns": [{"output_ids": O1, "env_ids": E1, "logprobs": L1}]}]}
st, t2, _ = srv.request("POST", "/v1/rollout", turn2)
g2 = t2["groups"][0] if st == 200 else {}
s2 = g2["samples"][0] if st == 200 else {}
if st != 200 or s2["response_ids"] != O1 + E1 + s2["output_ids"] or \
        s2["response_mask"] != [1] * len(O1) + [0] * len(E1) + [1] * len(s2["output_ids"]) or \
        s2["response_logprobs"] != L1 + [0.0] * len(E1) + s2["logprobs"] or s2["history_len"] != len(O1) + len(E1):
    reflib.fail(f"turn 2: {st} {t2}")
reuse = (len(P) + len(O1) - 1) // 16 * 16  # the blocks turn 1 computed in full
if g2["cached_prompt_tokens"] < reuse or g2["prompt_len"] != len(P):
    reflib.fail(f"turn 2 reused {g2['cached_prompt_tokens']} cached tokens, want at least {reuse}")
ctx = P + O1 + E1
with torch.no_grad():
    lp = torch.log_softmax(ref(torch.tensor([ctx + s2["output_ids"]])).logits[0].double(), -1).numpy()
worst = max(abs(l - lp[len(ctx) + j - 1][t]) for j, (t, l) in enumerate(zip(s2["output_ids"], s2["logprobs"])))
if worst > 1e-4 or any(lp[len(ctx) + j - 1].argmax() != t for j, t in enumerate(s2["output_ids"])):
    reflib.fail(f"turn 2 against transformers on the ids as they are: |dlogprob| {worst}")
for bad, words in (({"turns": []}, "non-empty"), ({"turns": [{"output_ids": O1, "logprobs": [0.0]}]}, "logprobs"),
                   ({"turns": [{"env_ids": [-1]}]}, "env_ids"), ({"turns": [{}]}, "no tokens"),
                   ({"turns": [{"env_ids": E1}], "continue_from": {"output_ids": O1}}, "do not go together")):
    st, r, _ = srv.request("POST", "/v1/rollout", {"groups": [dict({"input_ids": P}, **bad)]})
    if st != 400 or words not in r["error"]["message"]:
        reflib.fail(f"turns {bad}: {st} {r}")
print(f"ok  a two-turn agent loop on /v1/rollout: the call parsed, the tool's {len(E1)} tokens appended as ids, "
      f"{g2['cached_prompt_tokens']} of {len(ctx)} context tokens reused, response_mask/logprobs as veRL's, "
      f"|dlogprob| {worst:.1e} against transformers")
srv.stop()
print("PASS")
