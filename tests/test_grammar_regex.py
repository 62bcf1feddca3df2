"""test_grammar_regex.py: regular expressions through the grammar engine (regex -> GBNF ->
matcher, tests/grammar_harness match) against Python's re.fullmatch, the definition vLLM's
guided_regex and JSON Schema's pattern use.

For each of 60 patterns: strings generated from the pattern's own parse tree (Python's
sre_parse, an independent reading of the syntax) and those strings mutated (a character
dropped, doubled, replaced or added), plus random strings over the pattern's alphabet; the
engine must say "matches in full" exactly when re.fullmatch does. Then the constructs it
refuses (backreferences, lookaround, inline flags, word boundaries, inner anchors, possessive
quantifiers) must be refused with a message naming them."""
import json
import os
import random
import re
import subprocess

try:
    import re._parser as sre_parse
    import re._constants as sre_c
except ImportError:  # Python before 3.11
    import sre_constants as sre_c
    import sre_parse

import reflib

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "grammar_harness")
PATTERNS = [
    r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?", r"a*b+c?", r"(ab|a)(bc|c)", r"[^a-c]+", r"[\w.-]+", r"\s*x\s*", r"\D\W\S",
    r"[\d\s]+", r"[^\d\s]{2}", r"x{2}y{1,}z{0,2}", r"(a|b)*c", r"((a|b)(c|d))+", r"[\u00e9-\u00ff]+", r"日本|中国",
    r"\u00e9t\u00e9", r"[\x41-\x5a]+", r"a.b", r"\.\*\+\?\(\)\[\]\{\}\|\\\^\$", r"(?:ab)+", r"(?P<year>\d{4})-(?P<m>\d\d)",
    r"^abc$", r"\Aabc\Z", r"a+?b*?", r"a{,2}b", r"[-a]", r"[a-]", r"[]a]", r"[a\]]", r"\t\n", r"[\t ]+", r"(|a)b",
    r"(a|)b", r"a?b?c?", r"((((a))))", r"(ab){2,3}", r"[a-z0-9_]{1,12}@[a-z]{2,8}(\.[a-z]{2,4}){1,2}",
    r"\d+(,\d+)*", r"[A-Fa-f0-9]{8}-[A-Fa-f0-9]{4}", r"(\+|-)?\d+", r"a|b|c|d|e|f", r"x(y|z)?w", r"(a(b(c)?)?)?d",
    r"[^\n]*", r"[\[\]]+", r"#[0-9a-f]{6}", r"(true|false|null)", r"\$\d+\.\d\d", r"[aeiou]{2,}[^aeiou]",
    r"(a|ab)(c|bcd)(d*)", r"z{0}", r"(|yes|no)*[A-Z]", r"(a?)*b", r"(\s*x?)+y", r"(a*b*)*c", r"[😀-😂]+", r"(?:a|b)+?c", r"[ -~]{0,5}", r"\x41\u0042\U00000043", r"ab{1000}",
]
REFUSED = [
    (r"(a)\1", "backreference"), (r"(?P<x>a)(?P=x)", "backreference"), (r"a(?=b)", "lookahead"),
    (r"a(?!b)", "lookahead"), (r"(?<=a)b", "lookbehind"), (r"(?<!a)b", "lookbehind"), (r"(?i)abc", "inline flags"),
    (r"\bword\b", "word boundaries"), (r"a^b", "anchors"), (r"a$b", "anchors"), (r"a*+", "possessive"),
    (r"(a", "unbalanced"), (r"a)", "unbalanced"), (r"[a-", "unterminated"), (r"*a", "nothing to repeat"),
    (r"a{3,2}", "below m"), (r"a{1001}", "above 1000"), (r"\p{L}", "property"), (r"[z-a]", "backwards"),
]


def gen(tree, rng, depth=0):
    """a string the parsed pattern matches"""
    out = []
    for op, av in tree:
        if op == sre_c.LITERAL:
            out.append(chr(av))
        elif op == sre_c.NOT_LITERAL:
            out.append(gen_in([(sre_c.NEGATE, None), (sre_c.LITERAL, av)], rng))
        elif op == sre_c.ANY:
            out.append(rng.choice("ab1 é"))
        elif op == sre_c.IN:
            out.append(gen_in(av, rng))
        elif op == sre_c.BRANCH:
            out.append(gen(rng.choice(av[1]), rng, depth + 1))
        elif op == sre_c.SUBPATTERN:
            out.append(gen(av[-1], rng, depth + 1))
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
            lo, hi, sub = av
            hi = min(hi, lo + 3)
            out.append("".join(gen(sub, rng, depth + 1) for _ in range(rng.randint(lo, hi))))
        elif op == sre_c.AT:
            pass
        elif op == sre_c.CATEGORY:
            out.append(gen_in([(op, av)], rng))
        else:
            raise ValueError(op)
    return "".join(out)


def gen_in(items, rng):
    for _ in range(200):
        c = chr(rng.choice([rng.randint(32, 126), rng.randint(0xe0, 0xff), 0x65e5, 0x1f600, 9, 10]))
        if re.fullmatch(sre_pattern_in(items), c):
            return c
    return "a"


def sre_pattern_in(items):
    return "[" + "".join(_item(op, av) for op, av in items) + "]"


def _item(op, av):
    if op == sre_c.LITERAL:
        return re.escape(chr(av))
    if op == sre_c.RANGE:
        return re.escape(chr(av[0])) + "-" + re.escape(chr(av[1]))
    if op == sre_c.NEGATE:
        return "^"
    if op == sre_c.CATEGORY:
        return {sre_c.CATEGORY_DIGIT: r"\d", sre_c.CATEGORY_NOT_DIGIT: r"\D", sre_c.CATEGORY_WORD: r"\w",
                sre_c.CATEGORY_NOT_WORD: r"\W", sre_c.CATEGORY_SPACE: r"\s", sre_c.CATEGORY_NOT_SPACE: r"\S"}[av]
    raise ValueError(op)


def mutate(s, rng, alphabet):
    if not s:
        return rng.choice(alphabet)
    i = rng.randrange(len(s))
    k = rng.randrange(4)
    if k == 0:
        return s[:i] + s[i + 1:]
    if k == 1:
        return s[:i] + s[i] + s[i:]
    if k == 2:
        return s[:i] + rng.choice(alphabet) + s[i + 1:]
    return s[:i] + rng.choice(alphabet) + s[i:]


def ascii_only(s):
    """Python's \\d \\w \\s are Unicode-wide; ours are ASCII (documented): judge non-ASCII
    strings only where the pattern has none of them"""
    return all(ord(c) < 128 for c in s)


rng = random.Random(1)
n_strings = n_pos = 0
for pat in PATTERNS:
    tree = sre_parse.parse(pat)
    alphabet = sorted(set(c for c in pat if c.isprintable()) | set("ab09 _.-\t\né日😀x"))
    strings = set()
    for _ in range(25):
        s = gen(tree, rng)
        strings.add(s)
        strings.add(mutate(s, rng, alphabet))
        strings.add(mutate(mutate(s, rng, alphabet), rng, alphabet))
    for _ in range(20):
        strings.add("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))))
    shorthand = re.search(r"\\[dDwWsS]", pat) is not None
    strings = sorted(s for s in strings if not shorthand or ascii_only(s))
    inp = "".join(json.dumps(s) + "\n" for s in strings)
    r = subprocess.run([HARNESS, "-", "match", "regex", pat], input=inp, capture_output=True, text=True, check=True)
    got = r.stdout.split("\n")
    if got[0].startswith("error:"):
        reflib.fail(f"{pat!r}: refused: {got[0]}")
    for s, g in zip(strings, got):
        want = re.fullmatch(pat, s) is not None
        if (g == "1") != want:
            reflib.fail(f"{pat!r} on {s!r}: the engine says {g}, re.fullmatch says {int(want)}")
        n_pos += want
    n_strings += len(strings)
print(f"ok  {len(PATTERNS)} patterns, {n_strings} strings ({n_pos} matching): the engine agrees with re.fullmatch")

for pat, words in REFUSED:
    r = subprocess.run([HARNESS, "-", "match", "regex", pat], input="", capture_output=True, text=True, check=True)
    if not r.stdout.startswith("error:") or words not in r.stdout:
        reflib.fail(f"{pat!r}: want a refusal naming {words!r}, got {r.stdout!r}")
print(f"ok  {len(REFUSED)} unsupported constructs refused by name")
print("PASS")
