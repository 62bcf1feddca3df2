"""test_grammar_schema.py: JSON Schema through the grammar engine (schema -> GBNF -> matcher,
tests/grammar_harness) against Python's jsonschema (Draft 2020-12, formats checked).

Over a corpus of 150 schemas (pydantic's own output for real-world models: nested objects,
Optional and Literal fields, enums, lists of objects, dicts, recursive trees; and schemas
written for each keyword claimed: type lists, required subsets, additionalProperties
false/true/schema, enum, const, anyOf, oneOf, allOf, $ref/$defs with recursion, items,
prefixItems, minItems/maxItems, minLength/maxLength, pattern, the formats, integer ranges):

- every string the grammar produces (random walks over the bytes it allows, 25 per schema)
  is JSON and valid against the schema: the grammar is never too wide;
- hand-picked valid instances are accepted (the grammar is not too narrow, compact JSON), and
  invalid ones refused;
- each keyword the engine does not enforce is refused naming the keyword and its JSON pointer."""
import json
import os
import subprocess
from typing import Dict, List, Literal, Optional, Union

import jsonschema
import reflib
from pydantic import BaseModel, Field

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "grammar_harness")
FMT = jsonschema.Draft202012Validator.FORMAT_CHECKER


# ---- the corpus ----
class Address(BaseModel):
    street: str = Field(max_length=30)
    city: str = Field(max_length=20)
    zip: Optional[str] = Field(default=None, pattern=r"[0-9]{5}")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=130)
    email: Optional[str] = None
    role: Literal["admin", "user", "guest"]
    tags: List[str] = Field(default_factory=list, max_length=4)
    address: Optional[Address] = None


class Tree(BaseModel):
    value: int = Field(ge=-5, le=5)
    children: List["Tree"] = Field(default_factory=list, max_length=2)


class Order(BaseModel):
    id: int = Field(ge=1, le=99999)
    items: List[Dict[str, int]] = Field(max_length=3)
    status: Union[Literal["open"], Literal["closed"]]
    note: Optional[str] = Field(default=None, max_length=10)
    paid: bool


class Weather(BaseModel):
    city: str = Field(max_length=15)
    unit: Literal["c", "f"] = "c"
    days: int = Field(default=1, ge=1, le=7)


CORPUS = [m.model_json_schema() for m in (Address, Person, Tree, Order, Weather)]
for lo, hi in ((0, 0), (0, 9), (1, 10), (-5, 5), (-100, -3), (7, 123), (99, 1001), (-1000, 1000), (0, 65535),
               (123456, 124000), (-9, None), (None, -9), (15, None), (None, 15), (0, None), (None, None)):
    s = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    CORPUS.append(s)
CORPUS += [{"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9},
           {"type": "integer", "minimum": 2.5, "maximum": 7.5}]
for mn, mx in ((0, 0), (0, 3), (2, 2), (1, 5), (3, None), (0, None)):
    s = {"type": "string", "minLength": mn}
    if mx is not None:
        s["maxLength"] = mx
    CORPUS.append(s)
    a = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": mn}
    if mx is not None:
        a["maxItems"] = mx
    CORPUS.append(a)
for f in ("date", "time", "date-time", "uuid", "email", "ipv4"):
    CORPUS.append({"type": "string", "format": f})
for p in (r"[a-z]{2,5}", r"\d{3}-\d{2}", r"(red|green)+", r"[A-Z]\w{0,4}", r"a.b", r"[^a-z]{1,3}", r"x?y*z{1,2}"):
    CORPUS.append({"type": "string", "pattern": p})
CORPUS += [
    {"type": ["string", "null"], "maxLength": 3}, {"type": ["integer", "boolean"], "maximum": 5, "minimum": 0},
    {"type": "boolean"}, {"type": "null"}, {"type": "number"}, {"enum": ["a", 1, None, True, [1, 2], {"k": "v"}]},
    {"const": {"x": [1, "y"]}}, {"const": "é\"\\"}, {"enum": ["日本", "\u0001x", "tab\t"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}, "c": {"type": "null"}},
     "required": ["b"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "null"}}, "additionalProperties": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 3}},
    {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": True},
    {"type": "object", "additionalProperties": {"type": "boolean"}},
    {"type": "object", "additionalProperties": False},
    {"type": "object"}, {"type": "array", "maxItems": 2}, {},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 2}]},
    {"oneOf": [{"const": 1}, {"const": 2}, {"type": "null"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1}}, "required": ["a"]},
               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                      "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                     "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
    {"definitions": {"leaf": {"enum": [1, 2]}}, "type": "array", "items": {"$ref": "#/definitions/leaf"}, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": "x"}], "items": False},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 2}, {"const": 0}], "minItems": 1,
     "items": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50},
                                                                 "ok": {"type": "boolean"}},
                                "required": ["id"], "additionalProperties": False}, "maxItems": 3},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x", "title": "T", "description": "d",
     "$comment": "c", "type": "object", "properties": {"q": {"type": "string", "maxLength": 4, "default": "z",
                                                            "examples": ["a"], "deprecated": True}},
     "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "ip": {"type": "string", "format": "ipv4"}}, "required": ["when", "ip"],
     "additionalProperties": False},
]
while len(CORPUS) < 150:  # nested objects of growing depth
    d = len(CORPUS) % 7 + 1
    s = {"type": "integer", "minimum": 0, "maximum": len(CORPUS)}
    for k in range(d):
        s = {"type": "object", "properties": {f"k{k}": s, "z": {"type": "boolean"}}, "required": [f"k{k}"],
             "additionalProperties": False}
    CORPUS.append(s)

VALID = [  # (schema, instances the grammar must accept, instances it must refuse)
    (Person.model_json_schema(), [{"name": "Ada", "age": 36, "email": None, "role": "admin", "tags": ["x"],
                                   "address": {"street": "1 Main St", "city": "Oslo", "zip": "12345"}},
                                  {"name": "B", "age": 0, "role": "guest"}],
     [{"name": "B", "age": 131, "role": "guest"}, {"age": 3, "role": "user"}, {"name": "B", "age": 1, "role": "x"}]),
    ({"type": "integer", "minimum": -15, "maximum": 1234}, [-15, -9, 0, 7, 10, 999, 1000, 1234], [-16, 1235, 2000]),
    ({"type": "string", "format": "date-time"}, ["2024-02-28T23:59:59Z", "1999-12-31T00:00:00.123+05:30"],
     ["2024-02-28T23:59:59", "2024-13-01T00:00:00Z"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ({"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "maxItems": 3},
     [[], [True], [False, None, None]], [[None], [True, None, None, None]]),
    (CORPUS[-1], [], [{}]),
    # no type: the keywords' own type, held to them (the JSON-Schema-Test-Suite's cases)
    ({"minItems": 1, "maxItems": 2}, [[1], [1, "a"]], [[], [1, 2, 3]]),
    ({"maxLength": 2.0}, ["", "ab"], ["abc"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": False}},
     [{"a": 1}, {}], [{"b": 1}, {"a": 1, "b": 2}]),
    ({"anyOf": [False, {"type": "integer"}]}, [3], ["x"]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [3, "x"], [1.5, None]),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["kind", "x"], "additionalProperties": False},
                {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}},
                 "required": ["kind", "y"], "additionalProperties": False}]},
     [{"kind": "a", "x": 1}, {"kind": "b", "y": True}], [{"kind": "a", "y": True}, {"kind": "c", "x": 1}]),
    ({"allOf": [True, {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"]}]},
     [{"a": None}], [{}]),
    ({"$defs": {"a%b": {"type": "boolean"}}, "$ref": "#/$defs/a%25b"}, [True], [1]),
]

REFUSED = [
    ({"type": "integer", "multipleOf": 3}, "#/multipleOf"), ({"not": {"type": "null"}}, "#/not"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "hostname"}}}, "#/properties/a/format"),
    ({"type": "number", "minimum": 1.5}, "#/minimum"), ({"if": {}, "then": {}}, "#/if"),
    ({"type": "object", "patternProperties": {"x": {}}}, "#/patternProperties"),
    ({"type": "array", "uniqueItems": True}, "#/uniqueItems"), ({"type": "array", "contains": {}}, "#/contains"),
    ({"type": "object", "minProperties": 1}, "#/minProperties"), ({"$ref": "http://x/y"}, "#/$ref"),
    ({"$ref": "#/$defs/missing"}, "#/$ref"), ({"type": "strin"}, "#/type"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "#/propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
    ({"items": {"type": "integer", "exclusiveMinimum": "x"}}, "#/items/exclusiveMinimum"),
    ({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "additionalProperties": False}, "#/allOf"),
    # what would otherwise let an invalid value through (the JSON-Schema-Test-Suite's cases)
    ({"maximum": 3.0}, "#/maximum"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "#/oneOf"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "#/oneOf"),
    ({"oneOf": [{"enum": [1, "a"]}, {"const": 1.0}]}, "#/oneOf"),
    ({"allOf": [True, False]}, "#/allOf/1"),
    ({"allOf": [{"properties": {"foo": {}}}], "additionalProperties": {"type": "boolean"}}, "#/allOf"),
    ({"required": ["foo"]}, "#/required"),
    ({"enum": [1, 5], "minimum": 3}, "#/minimum"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "#/required"),
]


def harness(*args, inp=""):
    return subprocess.run([HARNESS, "-", *args], input=inp, capture_output=True, text=True, check=True).stdout


n_out = 0
for i, schema in enumerate(CORPUS):
    out = harness("sample", "schema", json.dumps(schema), "25", str(i))
    if out.startswith("error:"):
        reflib.fail(f"schema {i} {json.dumps(schema)[:200]}: refused: {out.strip()}")
    lines = [json.loads(x) for x in out.split("\n") if x]
    if len(lines) < 5:
        reflib.fail(f"schema {i}: only {len(lines)} of 25 walks ended")
    for text in lines:
        try:
            jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator, format_checker=FMT)
        except Exception as ex:  # noqa: BLE001
            reflib.fail(f"schema {i} {json.dumps(schema)[:300]}: the grammar produced {text!r}, not valid: {ex}")
        n_out += 1
print(f"ok  {len(CORPUS)} schemas, {n_out} outputs of their grammars: every one valid (jsonschema, formats checked)")

for schema, good, bad in VALID:
    texts = [json.dumps(x, separators=(",", ":"), ensure_ascii=False) for x in good + bad]
    got = harness("match", "schema", json.dumps(schema), inp="".join(json.dumps(t) + "\n" for t in texts)).split()
    for t, g, want in zip(texts, got, [1] * len(good) + [0] * len(bad)):
        if int(g) != want:
            reflib.fail(f"{json.dumps(schema)[:200]} on {t}: the grammar says {g}, want {want}")
print(f"ok  {sum(len(g) + len(b) for _, g, b in VALID)} instances accepted and refused as jsonschema judges them")

for schema, path in REFUSED:
    out = harness("match", "schema", json.dumps(schema))
    if not out.startswith("error:") or path not in out:
        reflib.fail(f"{schema}: want a refusal at {path}, got {out!r}")
print(f"ok  {len(REFUSED)} keywords not enforced: refused with their JSON pointer")
print("PASS")
