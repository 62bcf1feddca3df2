"""test_instructor.py: the `instructor` library (pinned in tests/requirements-instructor.txt)
against caraserve, in the modes its users pick: TOOLS (a named tool_choice whose arguments the
grammar holds to the function's parameters schema), JSON (response_format json_object, the
schema in the system prompt) and JSON_SCHEMA (response_format json_schema).

- A random-weight model with a real tokenizer and the Qwen2.5 template: TOOLS and
  JSON_SCHEMA give a validated pydantic object on every seed, nested models and enums
  included (the grammar does the work, so a random model is enough). Each request is seen on
  its way out (instructor's completion:kwargs hook) to carry what the mode sends.
- With the demo model (CS_DEMO_MODEL, SmolLM2): TOOLS, JSON and JSON_SCHEMA each return a
  City; JSON mode holds only what the model writes, so the conversation shows it one
  extraction first, as instructor's docs do with small models. SKIP for that part without
  the demo model.

instructor 1.17.0 caps jiter and rich below the versions the suite pins for openai, so it is
installed apart, without its dependencies, into .venv/instructor (quickstart does this)."""
import os
import sys
from typing import Annotated, List, Literal

import reflib
from openai import OpenAI
from pydantic import BaseModel, Field
from serverlib import Server, make_tok_model, set_chat_template

where = os.path.join(sys.prefix, "instructor")
if not os.path.isdir(os.path.join(where, "instructor")):
    print(f"SKIP: instructor is not installed in {where} (./quickstart test installs "
          "tests/requirements-instructor.txt there)")
    sys.exit(77)
sys.path.insert(0, where)
import instructor  # noqa: E402

if instructor.__version__ != "1.17.0":
    reflib.fail(f"instructor {instructor.__version__}, tests/requirements-instructor.txt pins 1.17.0")


class Address(BaseModel):
    street: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: List[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


def client_for(srv, mode, sent):
    c = instructor.from_openai(OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=600),
                               mode=mode)
    c.on("completion:kwargs", lambda *a, **kw: sent.append(kw))
    return c


def want_sent(mode, kw, name):
    if mode == instructor.Mode.TOOLS:
        ok = kw.get("tool_choice") == {"type": "function", "function": {"name": name}} and \
            [t["function"]["name"] for t in kw.get("tools", [])] == [name]
    elif mode == instructor.Mode.JSON:
        ok = kw.get("response_format") == {"type": "json_object"} and kw["messages"][0]["role"] == "system"
    else:
        ok = kw.get("response_format", {}).get("type") == "json_schema"
    if not ok:
        reflib.fail(f"{mode}: instructor did not send what the mode sends: {kw}")


model_dir, _, _ = make_tok_model("spm-32k", seed=9)
set_chat_template(model_dir, "qwen2.5-instruct")
srv = Server(["--model", model_dir, "--served-model-name", "m", "--threads", "2", "--kv-cache-bytes", "64M"])
for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    sent = []
    ic = client_for(srv, mode, sent)
    for seed in range(3):
        p = ic.chat.completions.create(model="m", response_model=Person, max_retries=0, seed=seed, max_tokens=400,
                                       messages=[{"role": "user", "content": "Extract: Ann, 31, admin, 1 Main St 12345."}])
        if not isinstance(p, Person) or not isinstance(p.address, Address):
            reflib.fail(f"{mode} seed {seed}: {p!r}")
        want_sent(mode, sent[-1], "Person")
    print(f"ok  random model, {mode.name}: 3 seeds give a validated Person ({p!r})")
srv.stop()

demo = os.environ.get("CS_DEMO_MODEL", "")
if not demo or not os.path.isdir(demo):
    print("SKIP: the demo-model part (CS_DEMO_MODEL is not set)")
else:
    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=10**11)

    srv = Server(["--model", demo, "--threads", "2", "--kv-cache-bytes", "256M"])
    name = OpenAI(base_url=srv.base + "/v1", api_key="none").models.list().data[0].id
    shown = [{"role": "user", "content": "Rome is the capital of Italy, population 2761632. Extract the city."},
             {"role": "assistant", "content": '{"name": "Rome", "country": "Italy", "population": 2761632}'},
             {"role": "user", "content": "Paris is the capital of France, population 2102650. Extract the city."}]
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON, instructor.Mode.JSON_SCHEMA):
        sent = []
        c = client_for(srv, mode, sent).chat.completions.create(model=name, response_model=City, max_retries=0,
                                                                temperature=0, max_tokens=200, messages=shown)
        if not isinstance(c, City):
            reflib.fail(f"demo {mode}: {c!r}")
        want_sent(mode, sent[-1], "City")
        print(f"ok  demo model, {mode.name}: {c!r}")
    srv.stop()
print("PASS")
