#!/usr/bin/env python3
"""gguf_tokenizer_corpus.py: writes the seeds of the gguf_tokenizer fuzz target
(tests/fuzz/corpus/gguf_tokenizer/): small GGUF files with tokenizer.ggml.* metadata, one per
kind tokenizer_gguf.c builds ("gpt2" byte-level BPE under the smollm, llama-bpe, qwen2 and
default pre-tokenizers; "llama" SentencePiece with byte tokens and scores), each with the
(2, 4) F32 tensor of tests/test_gguf_tokenizer.py's write_gguf.
Run as: .venv/bin/python tests/fuzz/gguf_tokenizer_corpus.py tests/fuzz/corpus/gguf_tokenizer"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from test_gguf_tokenizer import TT, write_gguf  # noqa: E402

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def byte_chars():
    """GPT-2's bytes_to_unicode: the 256 characters byte-level BPE spells bytes with"""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


# merges for the words of the target's fixed text, in rank order ("Ġ" is a space)
BPE_MERGES = ["l l", "H e", "o r", "Ġ w", "He ll", "Hell o", "Ġw or", "l d", "Ġwor ld", "Ġ c", "a f", "Ġc af",
              "1 2", "12 3", "Ġ Ġ", "Ã ©", "Ġcaf Ã©"]


def bpe(path, pre, specials, extra, with_types=True):
    tokens = byte_chars()
    for m in BPE_MERGES:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [TT.NORMAL] * len(tokens)
    for text, ty in specials:
        tokens.append(text)
        types.append(ty)
    ids = {t: i for i, t in enumerate(tokens)}
    ex = {k: ids[v] if isinstance(v, str) and k.endswith("_id") else v for k, v in extra.items()}
    write_gguf(path, "gpt2", tokens, types if with_types else None, pre=pre, merges=BPE_MERGES, extra=ex)


def spm(path):
    """Llama 2's layout: <unk> <s> </s>, the 256 byte tokens, then pieces; merges come from the
    scores (higher first), so each merged piece scores below the ones it is made of"""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256
    scores = [0.0] * len(tokens)
    chars = ["\u2581", "H", "e", "l", "o", "w", "r", "d", "c", "a", "f", "x", "1", "2", "3", "\u00e9"]
    pieces = ["ll", "or", "\u2581w", "He", "\u2581H", "\u2581He", "\u2581Hell", "\u2581Hello", "\u2581wor", "ld",
              "\u2581world", "\u2581c", "af", "\u2581caf", "\u2581caf\u00e9", "12", "123", "\u2581\u2581"]
    for c in chars:
        tokens.append(c)
        types.append(TT.NORMAL)
        scores.append(-1000.0 - len(scores))
    for r, p in enumerate(pieces):
        tokens.append(p)
        types.append(TT.NORMAL)
        scores.append(-float(r))
    tokens.append("<|im_start|>")
    types.append(TT.USER_DEFINED)
    scores.append(0.0)
    write_gguf(path, "llama", tokens, types, scores,
               extra={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                      "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_eos_token": False,
                      "tokenizer.chat_template": CHATML})


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                                                              "gguf_tokenizer")
    os.makedirs(out, exist_ok=True)
    bpe(os.path.join(out, "gpt2-smollm.gguf"), "smollm",
        [("<|endoftext|>", TT.CONTROL), ("<|im_start|>", TT.CONTROL), ("<|im_end|>", TT.CONTROL)],
        {"tokenizer.ggml.bos_token_id": "<|im_start|>", "tokenizer.ggml.eos_token_id": "<|im_end|>",
         "tokenizer.ggml.padding_token_id": "<|endoftext|>", "tokenizer.chat_template": CHATML})
    bpe(os.path.join(out, "gpt2-llama-bpe.gguf"), "llama-bpe",
        [("<|begin_of_text|>", TT.CONTROL), ("<|end_of_text|>", TT.CONTROL), ("<|start_header_id|>", TT.CONTROL),
         ("<|end_header_id|>", TT.CONTROL), ("<|eot_id|>", TT.CONTROL), ("<|eom_id|>", TT.CONTROL)],
        {"tokenizer.ggml.bos_token_id": "<|begin_of_text|>", "tokenizer.ggml.eos_token_id": "<|end_of_text|>",
         "tokenizer.ggml.eot_token_id": "<|eot_id|>", "tokenizer.ggml.eom_token_id": "<|eom_id|>",
         "tokenizer.chat_template": LLAMA3})
    bpe(os.path.join(out, "gpt2-qwen2.gguf"), "qwen2",
        [("<|endoftext|>", TT.CONTROL), ("<|im_start|>", TT.CONTROL), ("<|im_end|>", TT.CONTROL),
         ("<think>", TT.USER_DEFINED), ("[PAD300]", TT.UNUSED)],
        {"tokenizer.ggml.eos_token_id": "<|im_end|>", "tokenizer.ggml.add_bos_token": False,
         "tokenizer.ggml.add_eos_token": True, "tokenizer.chat_template": CHATML})
    # no tokenizer.ggml.pre and no token types: llama.cpp's defaults
    bpe(os.path.join(out, "gpt2-default.gguf"), None, [("<|endoftext|>", TT.CONTROL)],
        {"tokenizer.ggml.eos_token_id": "<|endoftext|>"}, with_types=False)
    spm(os.path.join(out, "llama-spm.gguf"))


if __name__ == "__main__":
    main()
