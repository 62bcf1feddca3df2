#!/usr/bin/env python3
"""test_gguf_tokenizer.py: tokenizers built from a GGUF file's metadata (text/tokenizer_gguf.c)
against the Python `tokenizers` library on the tokenizer.json the metadata was made from.

For the three vendored tokenizers (tests/data/tokenizers: llama-3.1 and qwen3, byte-level
"gpt2"; spm-32k, SentencePiece "llama"), a GGUF with the tokenizer metadata and one tiny tensor is
written with the `gguf` package the way llama.cpp's convert_hf_to_gguf.py writes one (tokens,
token types and, for "llama", scores as its vocabulary classes make them; gguf.SpecialVocab for
merges, special ids, add_bos/add_eos and the chat template). tests/tokenizer_harness, given the
.gguf, encodes test_ref_tokenizer.py's corpus (add_special True and False) and decodes (skip_special
True and False, whole and streamed): all must equal the reference's, and decode(encode(s)) == s
where the tokenizer is lossless; random id sequences must decode the same; bos, eos and the chat
template come through. What the conversion loses is reported, not hidden: llama.cpp's converter
marks added tokens that look special ("<|fim_prefix|>", ...) as CONTROL although Qwen's file
has them special=false, so the reference for qwen3 is its file with those flagged special (only
decode with skip_special_tokens sees the flag).

A SentencePiece GGUF keeps scores, not merges: here each piece's score is minus the rank of the
first merge making it, which is the order SentencePiece's own scores give (the vendored file's
merges come back exactly). With CS_DEMO_GGUF (the SmolLM2 demo's .gguf), its tokenizer is held
to the tokenizer.json tools/gguf_to_hf.py makes of it. Malformed or unsupported metadata must be
refused with a message naming what is wrong. Exits 77 when `tokenizers` or `gguf` is missing."""
import json
import logging
import lzma
import os
import random
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import gguf
    import numpy as np
    from tokenizers import Tokenizer
except ImportError as e:
    print(f"SKIP: {e.name} is not installed")
    sys.exit(77)

import test_ref_tokenizer as ref  # noqa: E402  (corpus, harness driver, comparisons)

logging.getLogger("gguf").setLevel(logging.ERROR)  # SpecialVocab's notes on the pair templates

WORK = os.path.join(ref.BUILD, "tests", "gguf-tokenizer-data")
PRE = {"llama-3.1": "llama-bpe", "qwen3": "qwen2"}
TT = gguf.TokenType


def looks_special(text):
    """convert_hf_to_gguf.py's does_token_look_special"""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def bpe_vocab(js, tok):
    """convert_hf_to_gguf.py's get_vocab_base on a tokenizer.json: tokens by id (missing ids as
    [PADn], UNUSED), added tokens CONTROL when special or special-looking, else USER_DEFINED,
    their text as decode(encode(text)) where the file does not normalize them."""
    vocab = dict(js["model"]["vocab"])
    added = {a["id"]: a for a in js["added_tokens"]}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(max(rev) + 1):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
            continue
        t = rev[i]
        if i in added:
            if not added[i]["normalized"]:
                t = tok.decode(tok.encode(t, add_special_tokens=False).ids, skip_special_tokens=False)
            types.append(TT.CONTROL if added[i]["special"] or looks_special(t) else TT.USER_DEFINED)
        else:
            types.append(TT.NORMAL)
        tokens.append(t)
    return tokens, types, None


def spm_vocab(js):
    """The tokens, types and scores convert_hf_to_gguf.py's _set_vocab_sentencepiece takes from a
    SentencePiece BPE model, rebuilt from its tokenizer.json: a piece's score is minus the rank of
    the first merge that makes it (SentencePiece ranks merges by the made piece's score), 0 for
    pieces no merge makes."""
    vocab = js["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in js["model"]["merges"]]
    first = {}
    for r, (a, b) in enumerate(merges):
        first.setdefault(a + b, r)
    special = {a["content"] for a in js["added_tokens"] if a["special"]}
    unk = js["model"].get("unk_token")
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = []
    for t in tokens:
        if t == unk:
            types.append(TT.UNKNOWN)
        elif t in special:
            types.append(TT.CONTROL)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(TT.BYTE)
        else:
            types.append(TT.NORMAL)
    return tokens, types, [-float(first[t]) if t in first else 0.0 for t in tokens]


def write_gguf(path, model, tokens, types, scores=None, pre=None, special_dir=None, merges=None, extra=None):
    """A GGUF with tokenizer metadata and a (2, 4) F32 token_embd.weight. extra: key -> value
    written as is (strings, bools, ints as u32, lists of strings), after the rest."""
    w = gguf.GGUFWriter(path + ".tmp", "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if special_dir:
        sv = gguf.SpecialVocab(special_dir, load_merges=model == "gpt2", n_vocab=len(tokens))
        sv.add_to_gguf(w, quiet=True)
    if merges is not None:
        w.add_token_merges(merges)
    if model == "llama":
        w.add_add_space_prefix(True)  # the sentencepiece model's add_dummy_prefix
    for k, v in (extra or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_string(k, v)
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".tmp", path)


def prepare(name):
    """tests/data/tokenizers/NAME decompressed into this test's own directory (test_ref_tokenizer
    may be writing its copy at the same time)"""
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    with lzma.open(os.path.join(ref.DATA, name, "tokenizer.json.xz"), "rb") as f, \
            open(os.path.join(d, "tokenizer.json"), "wb") as g:
        shutil.copyfileobj(f, g)
    shutil.copyfile(os.path.join(ref.DATA, name, "tokenizer_config.json"), os.path.join(d, "tokenizer_config.json"))
    return d


def make(name):
    """The GGUF for vendored tokenizer NAME and the reference Tokenizer (see the module doc)."""
    d = prepare(name)
    js = json.load(open(os.path.join(d, "tokenizer.json"), encoding="utf-8"))
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    path = os.path.join(WORK, name + ".gguf")
    if name in PRE:
        tokens, types, scores = bpe_vocab(js, tok)
        write_gguf(path, "gpt2", tokens, types, pre=PRE[name], special_dir=d)
    else:
        tokens, types, scores = spm_vocab(js)
        write_gguf(path, "llama", tokens, types, scores, special_dir=d)
    flipped = [a["content"] for a in js["added_tokens"] if not a["special"] and types[a["id"]] == TT.CONTROL]
    if flipped:
        for a in js["added_tokens"]:
            if a["content"] in flipped:
                a["special"] = True
        tok = Tokenizer.from_str(json.dumps(js))
    return path, tok, flipped


def check_info(path, tok, cfg_path, rep):
    """vocabulary size, bos, the first eos and the chat template, against tokenizer_config.json"""
    info = ref.run_harness(path, [{}], "--info")[0]
    cfg = json.load(open(cfg_path, encoding="utf-8"))

    def tid(key):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return tok.token_to_id(v) if v else None

    bos, eos = tid("bos_token"), tid("eos_token")
    rep.check("info", info["vocab_size"] == tok.get_vocab_size(with_added_tokens=True), f"vocab_size {info}")
    rep.check("info", info["bos_id"] == (bos if bos is not None else -1), f"bos {info['bos_id']} want {bos}")
    rep.check("info", info["eos_ids"][:1] == ([eos] if eos is not None else []), f"eos {info['eos_ids']} want {eos}")
    rep.check("info", info["chat_template"] == cfg.get("chat_template"), "chat_template differs")
    return info


def test_demo(texts, r):
    """The demo's .gguf (CS_DEMO_GGUF) against tools/gguf_to_hf.py's tokenizer.json of it."""
    demo = os.environ.get("CS_DEMO_GGUF")
    if not demo or not os.path.isfile(demo):
        print("note: CS_DEMO_GGUF not set, the demo model's GGUF tokenizer is not compared")
        return None
    sys.path.insert(0, os.path.join(ref.SRC, "tools"))
    import gguf_to_hf
    js, _ = gguf_to_hf.build_tokenizer(gguf_to_hf.GGUF(demo), {"max_position_embeddings": 2048})
    tok = Tokenizer.from_str(json.dumps(js))
    rep = ref.Report("demo GGUF (" + os.path.basename(demo) + ")")
    with ref.quiet_stderr():
        ref.test_encode("demo", demo, tok, texts, rep)
        ref.test_decode(demo, tok, rep, r)
    rep.show()
    return rep.ok()


def refused(path, want):
    p = subprocess.run([ref.HARNESS, path, "--info"], capture_output=True, text=True)
    return p.returncode != 0 and all(w in p.stderr for w in want), p.stderr.strip()


def test_refusals():
    """Metadata we cannot or will not build from: refused, the message naming the cause."""
    rep = ref.Report("refusals")
    toks = ["a", "b", "ab", "<s>"]
    cases = [
        ("model-bert", dict(model="bert", tokens=toks, types=[1, 1, 1, 3]),
         ["tokenizer.ggml.model 'bert'", "not supported"]),
        ("model-t5", dict(model="t5", tokens=toks, types=[1, 1, 1, 3]), ["tokenizer.ggml.model 't5'"]),
        ("pre-unknown", dict(model="gpt2", tokens=toks, types=[1, 1, 1, 3], pre="tekken", merges=["a b"]),
         ["tokenizer.ggml.pre 'tekken'", "not supported"]),
        ("merge-unknown-token",
         dict(model="gpt2", tokens=toks, types=[1, 1, 1, 3], pre="gpt-2", merges=["a b", "ab c"]),
         ["tokenizer.ggml.merges[1]", "'c'", "lacks"]),
        ("merge-unknown-result", dict(model="gpt2", tokens=toks, types=[1, 1, 1, 3], pre="gpt-2", merges=["b a"]),
         ["tokenizer.ggml.merges[0]", "'ba'", "lacks"]),
        ("merge-no-space", dict(model="gpt2", tokens=toks, types=[1, 1, 1, 3], pre="gpt-2", merges=["ab"]),
         ["tokenizer.ggml.merges[0]", "not 'left right'"]),
        ("no-merges", dict(model="gpt2", tokens=toks, types=[1, 1, 1, 3], pre="gpt-2"),
         ["without tokenizer.ggml.merges"]),
        ("types-count", dict(model="gpt2", tokens=toks, types=[1, 1, 3], pre="gpt-2", merges=["a b"]),
         ["tokenizer.ggml.token_type has 3 entries for 4 tokens"]),
        ("scores-count", dict(model="llama", tokens=toks, types=[1, 1, 1, 3], scores=[0.0, -1.0]),
         ["tokenizer.ggml.scores has 2 entries for 4 tokens"]),
        ("no-tokenizer", dict(model=None, tokens=None, types=None), ["no tokenizer.ggml.model"]),
    ]
    for name, kw, want in cases:
        path = os.path.join(WORK, "bad-" + name + ".gguf")
        if kw["model"] is None:
            w = gguf.GGUFWriter(path, "llama")
            w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        else:
            write_gguf(path, kw["model"], kw["tokens"], kw["types"], kw.get("scores"), kw.get("pre"),
                       merges=kw.get("merges"))
        ok, err = refused(path, want)
        rep.check("refused", ok, f"{name}: want {want} in the error, got {err!r}")
    # and what is fine: no pre (llama.cpp's 'default'), bos/eos defaults, an SPM without scores
    fine = os.path.join(WORK, "fine-defaults.gguf")
    write_gguf(fine, "gpt2", toks, [1, 1, 1, 3], merges=["a b"], extra={"tokenizer.ggml.bos_token_id": 3})
    got = ref.run_harness(fine, [{"text": "ab<s>ba", "add_special": True}])[0]
    rep.check("accepted", got.get("ids") == [2, 3, 1, 0], f"gpt2 without pre: {got}")
    fine = os.path.join(WORK, "fine-spm.gguf")
    write_gguf(fine, "llama", ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"],
               [2, 3, 3, 1, 1, 1, 1, 1, 1], extra={"tokenizer.ggml.bos_token_id": 1})
    got = ref.run_harness(fine, [{"text": "ab ba c", "add_special": True}])[0]
    # no scores: every merge ties, so vocabulary order decides (▁a before ab before ▁ab); c: <unk>
    rep.check("accepted", got.get("ids") == [1, 8, 3, 5, 4, 3, 0] and got.get("decode") == "<s> ab ba <unk>",
              f"llama without scores: {got}")
    rep.show()
    return rep.ok()


def main():
    if not os.path.exists(ref.HARNESS):
        raise SystemExit(f"FAIL: {ref.HARNESS} not built")
    os.makedirs(WORK, exist_ok=True)
    texts = ref.corpus()
    allcp = ref.all_codepoint_texts()
    print(f"corpus: {len(texts)} strings; all-code-point texts: {len(allcp)} strings")
    ok = test_refusals()
    r = random.Random(11)
    for name in ref.NAMES:
        path, tok, flipped = make(name)
        rep = ref.Report(f"{name} from GGUF")
        with ref.quiet_stderr():
            ref.test_encode(name, path, tok, texts, rep)
            if name in ref.ALLCP:
                ref.test_encode(None, path, tok, allcp, rep, add_specials=(False,), streams=False)
            ref.test_decode(path, tok, rep, r)
        check_info(path, tok, os.path.join(WORK, name, "tokenizer_config.json"), rep)
        rep.show()
        n = len(texts) + (len(allcp) if name in ref.ALLCP else 0)
        print(f"  {n} texts compared" + (f"; CONTROL in the GGUF, special=false in tokenizer.json: "
                                         f"{', '.join(flipped)}" if flipped else ""))
        ok = rep.ok() and ok
    demo = test_demo(texts, r)
    ok = ok and demo is not False
    if not ok:
        print("FAIL")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
