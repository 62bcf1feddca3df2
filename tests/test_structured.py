"""test_structured.py: structured output over HTTP, each output checked by an independent
judge: Python's re.fullmatch for regular expressions and grammars, membership for choices,
json + jsonschema (Draft 2020-12) for JSON schemas.

- A random-weight Llama with a real 32k SentencePiece tokenizer, base model and a peft
  adapter, constrained and unconstrained requests mixed in one batch: guided_regex,
  guided_choice, guided_grammar (GBNF and Lark, the latter judged by lark), guided_json, response_format json_schema, vLLM's
  structured_outputs, SGLang's regex/ebnf/json_schema fields; n > 1 and streamed; every
  output complete (finish_reason "stop") and valid. The schemas bound every string and
  array so that a random model ends them.
- Refusals: an unsupported keyword is a 400 naming it and its path; two constraints at once;
  a bad regex or grammar; beam search with a constraint.
- With the demo model (CS_DEMO_MODEL, SmolLM2): response_format json_object gives a JSON
  object, and the openai client's chat.completions.parse(response_format=<pydantic model>)
  returns a parsed object; SKIP for that part without it."""
import json
import os
import re
import threading

import jsonschema
import reflib
from hfmodels import make_adapter
from openai import OpenAI
from serverlib import Server, make_tok_model

model_dir, ref_base, _ = make_tok_model("spm-32k", seed=3)
a1_dir, _ = make_adapter(model_dir, ref_base, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=41)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules", f"a1={a1_dir}", "--threads", "2",
              "--kv-cache-bytes", "64M"])

REGEXES = [r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)",
           r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}", r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?"]
CHOICES = ["red", "green", "blue", "日本", "a \"quoted\" one"]
GBNF = ('root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}\n', r"\(\d{1,3}(\+\d{1,3}){0,3}\)")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["a", "b", None, 3]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


def post(body, path="/v1/completions"):
    st, r, _ = srv.request("POST", path, body)
    if st != 200:
        reflib.fail(f"{body}: {st} {r}")
    return r


def texts(r):
    out = []
    for c in r["choices"]:
        if c["finish_reason"] != "stop":
            reflib.fail(f"a constrained output did not complete: {c}")
        out.append(c["text"] if "text" in c else c["message"]["content"])
    return out


def check_regex(rx, t, what):
    if not re.fullmatch(rx, t):
        reflib.fail(f"{what}: {t!r} does not fullmatch {rx!r}")


def check_schema(schema, t, what):
    try:
        jsonschema.validate(json.loads(t), schema, cls=jsonschema.Draft202012Validator,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except Exception as ex:  # noqa: BLE001 - any failure is the test's
        reflib.fail(f"{what}: {t!r} is not valid: {ex}")


base = {"prompt": "Answer:", "max_tokens": 64, "temperature": 1.0, "seed": 7}
n_checked = 0
for model in ("base", "a1"):
    for rx in REGEXES:
        for t in texts(post({**base, "model": model, "n": 3, "guided_regex": rx})):
            check_regex(rx, t, f"guided_regex {model}")
            n_checked += 1
    for t in texts(post({**base, "model": model, "n": 4, "guided_choice": CHOICES})):
        if t not in CHOICES:
            reflib.fail(f"guided_choice: {t!r}")
        n_checked += 1
    for t in texts(post({**base, "model": model, "n": 3, "guided_grammar": GBNF[0]})):
        check_regex(GBNF[1], t, "guided_grammar")
        n_checked += 1
    for field in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                  {"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}):
        for t in texts(post({**base, "model": model, "n": 2, "max_tokens": 200, **field})):
            check_schema(SCHEMA, t, f"{list(field)[0]} {model}")
            n_checked += 1
for field in ({"structured_outputs": {"regex": REGEXES[0]}}, {"regex": REGEXES[0]}):
    for t in texts(post({**base, "model": "base", **field})):
        check_regex(REGEXES[0], t, list(field)[0])
for t in texts(post({**base, "model": "base", "ebnf": GBNF[0]})):
    check_regex(GBNF[1], t, "ebnf")
# a Lark grammar (vLLM's example), judged by lark itself
import lark  # noqa: E402

SQL = ('start: select_statement\n'
       'select_statement: "SELECT " column " from " table " where " condition\n'
       'column: "col_1" | "col_2"\n'
       'table: "table_1" | "table_2"\n'
       'condition: column "=" number\n'
       'number: "1" | "2"\n')
sql = lark.Lark(SQL, parser="earley", lexer="dynamic_complete")
for field in ({"guided_grammar": SQL}, {"structured_outputs": {"grammar": SQL}}):
    for t in texts(post({**base, "model": "a1", "n": 3, **field})):
        try:
            sql.parse(t)
        except lark.exceptions.LarkError as ex:
            reflib.fail(f"{field}: {t!r} is not in the Lark grammar's language: {ex}")
        n_checked += 1
print(f"ok  {n_checked} constrained outputs valid (regex, choice, grammar, JSON schema; base and adapter)")

# streamed: the pieces make a valid output
st, raw, _ = srv.request("POST", "/v1/completions", {**base, "model": "a1", "stream": True, "max_tokens": 200,
                                                     "guided_json": SCHEMA})
text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.splitlines()
               if line.startswith("data: {") and json.loads(line[6:])["choices"])
check_schema(SCHEMA, text, "streamed")

# one batch: constrained and unconstrained requests, base and adapter, at once
results = {}


def run(k, body):
    results[k] = srv.request("POST", "/v1/completions", body)


threads = []
for k in range(8):
    body = {**base, "model": "a1" if k % 2 else "base", "seed": k}
    if k % 4 == 0:
        body["guided_regex"] = REGEXES[k % len(REGEXES)]
    elif k % 4 == 1:
        body["guided_json"] = SCHEMA
        body["max_tokens"] = 200
    elif k % 4 == 2:
        body["max_tokens"] = 12
    threads.append(threading.Thread(target=run, args=(k, body)))
for t in threads:
    t.start()
for t in threads:
    t.join()
for k in range(8):
    st, r, _ = results[k]
    if st != 200:
        reflib.fail(f"mixed batch request {k}: {st} {r}")
    c = r["choices"][0]
    if k % 4 == 0:
        check_regex(REGEXES[k % len(REGEXES)], c["text"], f"mixed {k}")
    elif k % 4 == 1:
        check_schema(SCHEMA, c["text"], f"mixed {k}")
    elif k % 4 == 2 and r["usage"]["completion_tokens"] != 12:
        reflib.fail(f"mixed {k}: an unconstrained request ended early: {r}")
print("ok  constrained and unconstrained requests in one batch, streamed too")

# refusals
for body, param, words in (
        ({"guided_json": {"type": "integer", "multipleOf": 3}}, "guided_json", "multipleOf"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "not": {}}}}}, "guided_json",
         "#/properties/a/not"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one kind"),
        ({"guided_regex": "(a"}, "guided_regex", "guided_regex"),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "lookbehind"),
        ({"guided_grammar": "root ::= missing\n"}, "guided_grammar", "undefined rule 'missing'"),
        ({"guided_grammar": "root ::= root \"a\"\n"}, "guided_grammar", "left-recursive"),
        ({"guided_grammar": "start: x\n"}, "guided_grammar", "'x' is used but not defined (line 1)"),
        ({"guided_grammar": "start: /a/i\n"}, "guided_grammar", "flags"),
        ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "use_beam_search", "structured output"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag")):
    st, r, _ = srv.request("POST", "/v1/completions", {**base, "model": "base", **body})
    msg = json.dumps(r)
    if st != 400 or r.get("error", {}).get("param") != param or words.lower() not in msg.lower():
        reflib.fail(f"{body}: {st} {r} (want a 400 on {param} saying {words})")
print("ok  unsupported keywords, two constraints, bad regex and grammar, beam search: 400 by name")
srv.stop()

demo = os.environ.get("CS_DEMO_MODEL", "")
if not demo or not os.path.isdir(demo):
    print("SKIP: the demo-model part (CS_DEMO_MODEL is not set)")
else:
    from pydantic import BaseModel, Field

    srv = Server(["--model", demo, "--threads", "2", "--kv-cache-bytes", "256M"])
    client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=600)
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                       response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    obj = json.loads(r.choices[0].message.content)
    if not isinstance(obj, dict) or r.choices[0].finish_reason != "stop":
        reflib.fail(f"json_object: {r}")

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=10**11)

    p = client.chat.completions.parse(model=name, messages=[{"role": "user", "content": "Paris as JSON."}],
                                      response_format=City, max_tokens=300, temperature=0)
    city = p.choices[0].message.parsed
    if not isinstance(city, City):
        reflib.fail(f"chat.completions.parse: {p}")
    print(f"ok  demo model: json_object {obj}; parse() -> {city!r}")
    srv.stop()
print("PASS")
