"""json_schema_suite.py: the JSON schema compiler against the official JSON-Schema-Test-Suite
(github.com/json-schema-org/JSON-Schema-Test-Suite, draft 2020-12), which the project does
not carry: give a checkout's tests/draft2020-12 folder.

    CS_JSON_SCHEMA_SUITE=/path/to/JSON-Schema-Test-Suite/tests/draft2020-12 \\
        .venv/bin/python tests/json_schema_suite.py          (from build/, PYTHONPATH=../tests)

For the files of the keywords the compiler claims, each schema is compiled (tests/
grammar_harness). A refusal must name a keyword. An accepted schema is held to:
- soundness: no instance the suite calls invalid is matched (as compact JSON text);
- its own outputs: 20 strings sampled from the grammar are all valid under `jsonschema`;
- completeness, reported: the valid instances matched. The compiler by design fixes property
  order (as declared), allows no properties beyond those declared unless
  additionalProperties says so, and writes numbers as JSON does, so some valid instances are
  not matched; each is listed by reason.
Prints a summary; exits 1 on a soundness or sampling failure. SKIP (77) without the suite."""
import json
import os
import subprocess
import sys

import jsonschema

import reflib

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "grammar_harness")
SUITE = os.environ.get("CS_JSON_SCHEMA_SUITE", "")
FILES = ["additionalProperties", "allOf", "anyOf", "boolean_schema", "const", "default", "defs", "enum", "format",
         "items", "maxItems", "maxLength", "maximum", "minItems", "minLength", "minimum", "oneOf", "pattern",
         "prefixItems", "properties", "ref", "required", "type"]
if not SUITE or not os.path.isdir(SUITE):
    print("SKIP: set CS_JSON_SCHEMA_SUITE to a JSON-Schema-Test-Suite checkout's tests/draft2020-12")
    sys.exit(77)


def harness(*args, inp=""):
    r = subprocess.run([HARNESS, "-", *args], input=inp, capture_output=True, text=True, timeout=300)
    return r.stdout.splitlines()


def compact(x):
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def reason(schema, data):
    """why a valid instance may not be matched: the compiler's stated choices"""
    text = json.dumps(schema)
    if isinstance(data, dict) or "properties" in text:
        return "property order or undeclared properties"
    if isinstance(data, float) and data == int(data):
        return "a whole number written as a float"
    return None


groups = refused = accepted = sound_fail = 0
valid_total = valid_matched = sampled = 0
unmatched = {}
reasons = {}
fails = []
for name in FILES:
    for group in json.load(open(os.path.join(SUITE, name + ".json"))):
        groups += 1
        schema = group["schema"]
        spec = json.dumps(schema)
        inp = "".join(json.dumps(compact(t["data"])) + "\n" for t in group["tests"])
        out = harness("match", "schema", spec, inp=inp)
        if out and out[0].startswith("error:"):
            out = ["\\n".join(out)]  # a message may hold a newline of the schema's own
            refused += 1
            if " at #" not in out[0]:
                fails.append(f"{name}: {group['description']}: refused without the keyword's JSON pointer: {out[0]}")
            reasons[out[0].split(" at #")[0][7:]] = reasons.get(out[0].split(" at #")[0][7:], 0) + 1
            continue
        accepted += 1
        if len(out) != len(group["tests"]):
            fails.append(f"{name}: {group['description']}: {len(out)} answers for {len(group['tests'])}")
            continue
        for t, got in zip(group["tests"], out):
            if not t["valid"] and got == "1":
                sound_fail += 1
                fails.append(f"{name}: {group['description']}: {t['description']}: {compact(t['data'])} matched "
                             "but the suite calls it invalid")
            if t["valid"]:
                valid_total += 1
                if got == "1":
                    valid_matched += 1
                else:
                    r = reason(schema, t["data"]) or f"other ({name}: {t['description']})"
                    unmatched[r] = unmatched.get(r, 0) + 1
        val = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        for line in harness("sample", "schema", spec, "20", "1"):
            if line.startswith("error:"):
                break
            s = json.loads(line)
            sampled += 1
            errs = list(val.iter_errors(json.loads(s)))
            if errs:
                fails.append(f"{name}: {group['description']}: sampled {s!r} is invalid: {errs[0].message}")
print(f"{groups} schemas from {len(FILES)} files: {accepted} compiled, {refused} refused by keyword")
for r, n in sorted(reasons.items(), key=lambda x: -x[1]):
    print(f"    refused {n}x: {r}")
print(f"soundness: {sound_fail} invalid instances matched")
print(f"outputs: {sampled} sampled strings, {sum(1 for f in fails if 'sampled' in f)} invalid")
print(f"completeness: {valid_matched} of {valid_total} valid instances matched; the rest: {unmatched}")
for f in sorted(set(f.split(": sampled")[0].split(": {")[0] for f in fails)):
    print("FAIL:", f)
if fails:
    sys.exit(1)
print("PASS")
