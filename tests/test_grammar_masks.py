"""test_grammar_masks.py: the grammar engine's view of three real vocabularies (Llama 3.1 and
Qwen3, byte-level BPE; a 32k SentencePiece with byte fallback), against Hugging Face
`tokenizers`:

- every token's bytes (tests/grammar_harness bytes) are the bytes the token stands for
  inside a text: byte-level tokens through GPT-2's byte table, SentencePiece pieces with
  U+2581 as a space and <0xNN> as the byte; special tokens have none;
- on random walks through several grammars the cached-class mask equals the per-token
  reference mask at every step (the harness exits 1 on a difference)."""
import json
import os
import subprocess
import sys

import reflib
from serverlib import tokenizer_dir
from tokenizers import Tokenizer

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "grammar_harness")

GRAMMARS = {
    "json": r'''root ::= object
value ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ( string ":" value ("," string ":" value)* )? "}"
array ::= "[" ( value ("," value)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
''',
    "email": r'''root ::= [a-z0-9._]{1,12} "@" [a-z]{2,8} ("." [a-z]{2,4}){1,2}
''',
    "words": r'''root ::= item (", " item){0,5} "."
item ::= "red" | "green" | "blue" | [\u4e00-\u9fff]{1,3} | "\u00e9t\u00e9" | [0-9]+
''',
}


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def expected_bytes(tok, tid, bytelevel, bd):
    s = tok.id_to_token(tid)
    if s is None:
        return None
    if bytelevel:
        if all(c in bd for c in s):
            return bytes(bd[c] for c in s)
        return s.encode()
    if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
        return bytes([int(s[3:5], 16)])
    return s.replace("\u2581", " ").encode()


n_walks = 0
for name in ("llama-3.1", "qwen3", "spm-32k"):
    d = tokenizer_dir(name)
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer.json")) as f:
        spec = json.load(f)
    specials = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    bytelevel = "ByteLevel" in json.dumps(spec.get("decoder"))
    bd = byte_decoder()
    out = subprocess.run([HARNESS, d, "bytes"], capture_output=True, text=True, check=True).stdout
    bad = 0
    n = 0
    for line in out.splitlines():
        tid, hexs = line.split(" ")
        tid = int(tid)
        want = None if tid in specials else expected_bytes(tok, tid, bytelevel, bd)
        got = None if hexs == "-" else bytes.fromhex(hexs)
        if want == b"":
            want = None
        if got != want:
            bad += 1
            if bad < 5:
                print(f"{name}: token {tid} {tok.id_to_token(tid)!r}: {got!r} vs {want!r}")
        n += 1
    if bad:
        reflib.fail(f"{name}: {bad} of {n} tokens' bytes differ from tokenizers'")
    print(f"ok  {name}: the bytes of all {n} tokens equal tokenizers' ({'byte-level' if bytelevel else 'SentencePiece'})")
    for gname, text in GRAMMARS.items():
        gpath = os.path.join(reflib.tmpdir("cs_gbnf_"), gname + ".gbnf")
        with open(gpath, "w") as f:
            f.write(text)
        for seed in (1, 2):
            r = subprocess.run([HARNESS, d, "walk", gpath, str(seed), "40"], capture_output=True, text=True)
            if r.returncode != 0:
                reflib.fail(f"{name} {gname} seed {seed}: {r.stderr.strip()}")
            n_walks += 1
        print(f"ok  {name} {gname}: fast mask == reference mask on 2 walks ({r.stdout.strip()})")
print(f"PASS ({n_walks} walks)")
sys.exit(0)
