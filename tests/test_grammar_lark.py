"""test_grammar_lark.py: Lark grammars through the grammar engine (Lark -> GBNF -> matcher,
tests/grammar_harness) against the `lark` library itself (pinned in tests/requirements.txt),
parsing with Earley and its complete dynamic lexer, the reading closest to the grammar's
language.

For each grammar of the corpus (vLLM's SQL example, JSON with %ignore and common imports, a
calculator whose rules start with themselves, regex terminals, ranges, the i flag, ~ and {}
repeats, optionals, aliases, priorities, continuation lines, ...):
- strings sampled from the engine's own grammar are all parsed by lark;
- those strings mutated (a character dropped, doubled, replaced or added) and random strings
  over the grammar's alphabet are matched by the engine exactly when lark parses them.
Then what the translation refuses (templates, %declare/%override/%extend, imports other than
common, regex flags, a rule inside a terminal, an undefined name, no start rule) is refused
with a message naming it."""
import json
import os
import random
import subprocess

import lark

import reflib

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "grammar_harness")
if lark.__version__ != "1.3.1":
    reflib.fail(f"lark {lark.__version__}, tests/requirements.txt pins 1.3.1")

CORPUS = [
    # vLLM's guided_grammar example
    ('start: select_statement\n'
     'select_statement: "SELECT " column " from " table " where " condition\n'
     'column: "col_1" | "col_2"\n'
     'table: "table_1" | "table_2"\n'
     'condition: column "=" number\n'
     'number: "1" | "2"\n', "SELECTcolfrmtabewh_12= "),
    # JSON as Lark's own docs write it (bounded strings and numbers so that walks end)
    ('?start: value\n'
     '?value: object\n'
     '      | array\n'
     '      | string\n'
     '      | SIGNED_NUMBER      -> number\n'
     '      | "true"             -> true\n'
     '      | "false"            -> false\n'
     '      | "null"             -> null\n'
     'array  : "[" [value ("," value)*] "]"\n'
     'object : "{" [pair ("," pair)*] "}"\n'
     'pair   : string ":" value\n'
     'string : ESCAPED_STRING\n'
     '%import common.ESCAPED_STRING\n'
     '%import common.SIGNED_NUMBER\n'
     '%import common.WS\n'
     '%ignore WS\n', '{}[],:"\\ab1-.e truefalsn\n'),
    # a calculator: left recursion, ?rules, aliases, %ignore of an inline terminal
    ('?start: sum\n'
     '?sum: product\n'
     '    | sum "+" product   -> add\n'
     '    | sum "-" product   -> sub\n'
     '?product: atom\n'
     '    | product "*" atom  -> mul\n'
     '    | product "/" atom  -> div\n'
     '?atom: NUMBER           -> number\n'
     '     | "-" atom         -> neg\n'
     '     | NAME             -> var\n'
     '     | "(" sum ")"\n'
     'NAME: /[a-z]{1,3}/\n'
     'NUMBER: /[0-9]{1,3}/\n'
     '%ignore " "\n', "+-*/() 12ab"),
    # regex terminals, ranges, the i flag, repeats, optionals, priorities, comments
    ('start: greeting ("," name)~1..3 [PUNCT] // a comment\n'
     'greeting: "hello"i | "hi"i\n'
     'name: CAP LOWER~1..4\n'
     'CAP.2: "A".."Z"\n'
     'LOWER: "a".."z"\n'
     'PUNCT: /[.!?]/\n', "helohiHELOI,AZbz.!?x"),
    # terminals built from terminals, _names, !rules, ~ n
    ('start: date "T" time\n'
     '!date: YEAR "-" _MM "-" _DD\n'
     'time: _HH ":" _MM\n'
     'YEAR: DIGIT~4\n'
     '_MM: DIGIT DIGIT\n'
     '_DD: DIGIT~2\n'
     '_HH: /[01][0-9]|2[0-3]/\n'
     '%import common.DIGIT\n', "0123459T:-"),
    # CSV with newlines, imports in a list, an alias on import
    ('start: row (NL row)* NL?\n'
     'row: cell ("," cell)*\n'
     'cell: WORD | INT | QUOTED\n'
     'QUOTED: "\\"" /[^"\\n]{0,4}/ "\\""\n'
     '%import common (WORD, INT)\n'
     '%import common.NEWLINE -> NL\n', 'ab12,"\n\r x'),
    # %ignore with two terminals, comments; a rule whose alternatives end the same way
    ('start: stmt+\n'
     'stmt: KEY "=" VAL ";"\n'
     'KEY: /[a-c]{1,2}/\n'
     'VAL: /[0-9]{1,2}/ | "on" | "off"\n'
     'COMMENT: /#[a-z ]{0,5}\\n/\n'
     '%ignore COMMENT\n'
     '%ignore /[ \\t]+/\n', "abc=;0189onf# \n\tx"),
    # empty alternatives, nested optionals and groups, escapes in strings
    ('start: "<" (item ("|" item)*)? ">"\n'
     'item: "\\t" | "x" [["y"] "z"] | ("q" | ) "!"\n', "<>|\txyzq!"),
    # a rule that is only reached by itself after a first alternative
    ('start: list\n'
     'list: list "," ITEM\n'
     '    | ITEM\n'
     'ITEM: /[ab]/\n', "ab,c"),
    # a start rule named root (GBNF's habit) without start
    ('root: "a" root | "b"\n', "abc"),
]


def parser(src):
    return lark.Lark(src, parser="earley", lexer="dynamic_complete", start="root" if "start" not in src else "start")


def lark_parses(p, s):
    try:
        p.parse(s)
        return True
    except lark.exceptions.LarkError:
        return False


def mutate(s, rng, alphabet):
    if not s:
        return rng.choice(alphabet)
    i = rng.randrange(len(s))
    op = rng.randrange(4)
    if op == 0:
        return s[:i] + s[i + 1:]
    if op == 1:
        return s[:i] + s[i] + s[i:]
    if op == 2:
        return s[:i] + rng.choice(alphabet) + s[i + 1:]
    return s[:i] + rng.choice(alphabet) + s[i:]


def harness(*args, inp=""):
    r = subprocess.run([HARNESS, "-", *args], input=inp, capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


total = 0
for k, (src, alphabet) in enumerate(CORPUS):
    p = parser(src)
    out = harness("sample", "lark", src, "60", str(k + 1))
    if out and out[0].startswith("error:"):
        reflib.fail(f"grammar {k}: refused: {out[0]}\n{src}")
    samples = [json.loads(x) for x in out]
    if len(samples) < 20:
        reflib.fail(f"grammar {k}: only {len(samples)} samples")
    for s in samples:
        if not lark_parses(p, s):
            reflib.fail(f"grammar {k}: the engine produced {s!r}, which lark does not parse\n{src}")
    rng = random.Random(k)
    probes = list(samples)
    for s in samples:
        for _ in range(6):
            probes.append(mutate(s, rng, alphabet))
    for _ in range(150):
        probes.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))))
    probes = list(dict.fromkeys(probes))
    got = harness("match", "lark", src, inp="".join(json.dumps(s) + "\n" for s in probes))
    if len(got) != len(probes):
        reflib.fail(f"grammar {k}: {len(got)} answers for {len(probes)} strings: {got[:3]}")
    accepted = 0
    for s, g in zip(probes, got):
        want = lark_parses(p, s)
        accepted += want
        if (g == "1") != want:
            reflib.fail(f"grammar {k}: {s!r}: the engine says {g}, lark {'parses' if want else 'does not parse'} it\n{src}")
    if accepted == len(probes) or accepted == 0:
        reflib.fail(f"grammar {k}: the probes are all {'accepted' if accepted else 'refused'}; they test nothing")
    total += len(probes)
    print(f"ok  grammar {k}: {len(samples)} samples parsed by lark; {len(probes)} strings ({accepted} in the language) "
          "judged alike")

# {m,n} (llguidance's spelling, which lark lacks) reads as ~ m..n
brace = CORPUS[3][0].replace("LOWER~1..4", "LOWER{1,4}")
probes = [json.dumps(s) + "\n" for s in ("hi,Ab", "hi,Abcde", "hi,Abcdef", "HELLO,A", "Hi,Ab,Cd,Ef!", "hi,Ab,Cd,Ef,Gh")]
a, b = harness("match", "lark", CORPUS[3][0], inp="".join(probes)), harness("match", "lark", brace, inp="".join(probes))
if a != b or a != ["1", "1", "0", "0", "1", "0"]:
    reflib.fail(f"{{1,4}} and ~1..4 differ: {a} {b}")
print("ok  {1,4} reads as ~1..4")

REFUSED = [
    ('start: _sep{x, ","}\n_sep{a, b}: a (b a)*\nx: "x"\n', "templates"),
    ('start: A\n%declare A\n', "%declare"),
    ('start: "a"\n%override start: "b"\n', "%override"),
    ('start: "a"\n%extend start: "b"\n', "%extend"),
    ('start: X\n%import .other.X\n', "%import common"),
    ('start: /ab/i\n', "flags"),
    ('start: A\nA: "a" b\nb: "b"\n', "uses the rule 'b'"),
    ('start: a\n', "'a' is used but not defined"),
    ('x: "a"\n', "no rule named 'start'"),
    ('start: "a"\nstart: "b"\n', "defined twice"),
    ('start: "a" (\n', "expecting ')'"),
    ('start: /a(?=b)/\n', "lookahead"),
    ('start: %s\n' % ('"b".."a"'), "backwards"),
    ('start: x\nx: x "a"\n', "starts with itself"),
    ('start: "a"\n%import common.NOPE\n', "not a terminal of common"),
]
for src, words in REFUSED:
    out = harness("match", "lark", src)
    if not out or not out[0].startswith("error:") or words.lower() not in out[0].lower() or "line" not in out[0]:
        reflib.fail(f"{src!r}: want an error saying {words!r} and the line, got {out}")
print(f"ok  {len(REFUSED)} constructs refused by name and line")
print(f"PASS ({total} strings)")
