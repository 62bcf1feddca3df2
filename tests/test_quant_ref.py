#!/usr/bin/env python3
"""test_quant_ref.py: base/quant.c against the `gguf` Python package (GGUF's reference code).

Through tests/quant_harness:
- dequantization of every block type (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K) and of F16 and
  BF16: random block bytes whose F16 scale fields hold finite random halves of every
  magnitude (subnormals, zero, negative), ~2000 blocks a type, must equal
  gguf.quants.dequantize bit for bit (compared as uint32 patterns, no NaN in either);
- quantization to Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 (Gaussian blocks of scales 1e-6 to 1e4, zero and
  constant blocks, blocks whose scaled values sit exactly on the .5 rounding ties, scales
  that overflow F16) must give gguf.quants.quantize's bytes exactly;
- the K quantizers (gguf has none) must give blocks the reference decodes to what our
  dequantization gives, within the relative RMS error bounds below;
- cs_quant_dot_ref must equal the float64 dot of the reference's dequantized row.
Run by tests/pyrun.sh with CS_SRCDIR and CS_BUILDDIR set; exits 77 (skip) without numpy/gguf.
"""
import os
import subprocess
import sys

SRC = os.environ.get("CS_SRCDIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BUILD = os.environ.get("CS_BUILDDIR", SRC)
HARNESS = os.path.join(BUILD, "tests", "quant_harness")

try:
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES
except ImportError:
    print("SKIP: python packages 'numpy' and 'gguf' not available")
    sys.exit(77)

# byte offsets of each type's F16 scale fields (d, and dmin or m) inside its block
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
BLOCK_TYPES = list(HALF_FIELDS)
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# relative RMS error (||x - dequant(quant(x))|| / ||x||) of the K quantizers on Gaussian rows;
# tests/test_quant.c states the same bounds and the values measured
K_BOUND = {"Q4_K": 0.085, "Q5_K": 0.043, "Q6_K": 0.021}

rng = np.random.default_rng(20240611)
failures = []


def harness(cmd, qtype, n, data):
    r = subprocess.run([HARNESS, cmd, qtype, str(n)], input=data, capture_output=True, check=False)
    if r.returncode != 0:
        sys.exit(f"FAIL: quant_harness {cmd} {qtype} {n}: exit {r.returncode}: {r.stderr.decode()}")
    return r.stdout


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def random_halves(k):
    """k finite F16 bit patterns: every exponent (0 = zero/subnormal) equally likely, either sign"""
    h = rng.integers(0, 1 << 16, size=k, dtype=np.uint32)
    exp = rng.integers(0, 31, size=k, dtype=np.uint32)  # never 31 (inf/NaN)
    return ((h & 0x83FF) | (exp << 10)).astype(np.uint16)


def same_bits(a, b):
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def first_diff(a, b):
    i = int(np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))[0])
    return f"element {i}: ours {a[i]!r} ({a.view(np.uint32)[i]:#010x}), gguf {b[i]!r} ({b.view(np.uint32)[i]:#010x})"


def test_dequant():
    nblocks = 2000
    for name in BLOCK_TYPES:
        qt = T[name]
        bsz, tsz = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(nblocks, tsz), dtype=np.uint8)
        for off in HALF_FIELDS[name]:
            raw[:, off:off + 2] = random_halves(nblocks).view(np.uint8).reshape(nblocks, 2)
        # a few blocks with small everyday scales and the extremes of the scale bytes
        raw[:16, HALF_FIELDS[name][0]:HALF_FIELDS[name][0] + 2] = \
            np.float16(0.01).reshape(1).view(np.uint8)
        if name in ("Q4_K", "Q5_K"):
            raw[16:32, 4:16] = 0xFF  # every 6-bit scale and minimum 63
        if name == "Q6_K":
            raw[16:32, 192:208] = 0x80  # every scale -128
        n = nblocks * bsz
        ours = np.frombuffer(harness("dequant", name, n, raw.tobytes()), dtype=np.float32)
        ref = quants.dequantize(raw.reshape(-1), qt).reshape(-1).astype(np.float32, copy=False)
        ok = same_bits(ours, ref)
        check(ok, f"dequant {name}: not bit-identical to gguf ({first_diff(ours, ref) if ours.shape == ref.shape and not ok else ours.shape})")
        check(not np.isnan(ours).any() and not np.isnan(ref).any(), f"dequant {name}: NaN")
        if ok:
            print(f"dequant {name}: {nblocks} blocks, {n} values bit-identical to gguf")

    n = 2000 * 32
    h = random_halves(n)
    ours = np.frombuffer(harness("dequant", "F16", n, h.tobytes()), dtype=np.float32)
    ref = quants.dequantize(h.view(np.uint8), T.F16).astype(np.float32)
    check(same_bits(ours, ref), "dequant F16: not bit-identical")
    b = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    b[(b & 0x7F80) == 0x7F80] &= 0xBFFF  # no inf/NaN: exponent 0xFF becomes 0x7F
    ours = np.frombuffer(harness("dequant", "BF16", n, b.tobytes()), dtype=np.float32)
    ref = quants.dequantize(b.view(np.uint8), T.BF16).reshape(-1)
    check(same_bits(ours, ref), "dequant BF16: not bit-identical")
    check(not np.isnan(ours).any(), "dequant F16/BF16: NaN")
    print(f"dequant F16, BF16: {n} values each bit-identical to gguf")


def tie_blocks(name, k):
    """k blocks whose scale comes out exactly 1 (times a power of two), so every other value,
    placed on a half-integer, sits exactly on a rounding tie of the quantizer"""
    half = {"Q8_0": None, "Q4_0": 8, "Q5_0": 16, "Q4_1": 15, "Q5_1": 31}[name]
    out = np.empty((k, 32), dtype=np.float32)
    for i in range(k):
        if name == "Q8_0":  # amax 127: d = 1, x*id = x, roundf ties away from zero
            x = rng.integers(-127, 127, size=32) + 0.5
            x[rng.integers(32)] = 127.0 * rng.choice([-1, 1])
        elif name in ("Q4_0", "Q5_0"):  # max = -half: d = 1, x*id + half + .5 is an integer
            x = -(rng.integers(-half, half - 1, size=32) + 0.5)
            x[rng.integers(32)] = -float(half) * rng.choice([1, -1])
        else:  # min 0, max = nmax: d = 1, (x - min) + .5 is an integer
            x = rng.integers(0, half, size=32) + 0.5
            x[rng.integers(32)] = 0.0
            x[rng.integers(32)] = float(half)
        out[i] = x * 2.0 ** int(rng.integers(-20, 12))
    return out


def quant_rows(name):
    """the rows, as one (k, 32) array of blocks, that the 32-element quantizers are fed"""
    k = 2000
    g = rng.standard_normal((k, 32)).astype(np.float32)
    g *= (10.0 ** rng.uniform(-6, 4, size=(k, 1))).astype(np.float32)
    g[::50] = 0  # zero blocks
    g[7::50] = np.float32(rng.standard_normal())  # constant blocks
    g[9::50, 3] *= 1000  # one large value
    g[11::50] *= np.float32(1e5)  # scales above F16's largest: d overflows to inf in both
    g[13::50] = np.abs(g[13::50])  # all positive
    return np.concatenate([g, tie_blocks(name, 500)]).astype(np.float32)


def test_quantize_legacy():
    for name in LEGACY:
        qt = T[name]
        x = quant_rows(name)
        with np.errstate(all="ignore"):
            ref = quants.quantize(x, qt).reshape(-1)
        ours = np.frombuffer(harness("quantize", name, x.size, x.tobytes()), dtype=np.uint8)
        same = ours.shape == ref.shape and np.array_equal(ours, ref)
        if not same and ours.shape == ref.shape:
            tsz = GGML_QUANT_SIZES[qt][1]
            bad = np.flatnonzero((ours.reshape(-1, tsz) != ref.reshape(-1, tsz)).any(axis=1))
            print(f"  {name}: {bad.size} blocks differ, first {bad[0]}: input {x[bad[0]]!r}")
        check(same, f"quantize {name}: bytes differ from gguf.quants.quantize")
        if same:
            print(f"quantize {name}: {x.shape[0]} blocks (2000 random, 500 on rounding ties) byte-identical to gguf")


def test_quantize_k():
    for name, bound in K_BOUND.items():
        qt = T[name]
        rows, n = 64, 4096
        x = rng.standard_normal((rows, n)).astype(np.float32)
        x *= (10.0 ** rng.uniform(-3, 3, size=(rows, 1))).astype(np.float32)
        blob = harness("quantize", name, x.size, x.tobytes())
        raw = np.frombuffer(blob, dtype=np.uint8)
        check(raw.size == x.size // 256 * GGML_QUANT_SIZES[qt][1], f"quantize {name}: wrong size")
        ref = quants.dequantize(raw, qt).reshape(rows, n)
        ours = np.frombuffer(harness("dequant", name, x.size, blob), dtype=np.float32).reshape(rows, n)
        check(same_bits(ours, ref), f"quantize {name}: our dequantization differs from gguf's")
        check(np.isfinite(ref).all(), f"quantize {name}: non-finite values")
        err = np.sqrt(((ref - x) ** 2).mean(axis=1)) / np.sqrt((x ** 2).mean(axis=1))
        check(err.max() < bound, f"quantize {name}: relative RMS error {err.max():.4f} >= {bound}")
        print(f"quantize {name}: {rows} rows of {n}, decoded by gguf; relative RMS error "
              f"mean {err.mean():.4f} max {err.max():.4f} (bound {bound})")


def test_dot():
    n = 1024
    for name in BLOCK_TYPES:
        qt = T[name]
        x = rng.standard_normal(n).astype(np.float32)
        blob = harness("quantize", name, n, x.tobytes())
        a = rng.standard_normal(n).astype(np.float32)
        ours = float(harness("dot", name, n, blob + a.tobytes()))
        w = quants.dequantize(np.frombuffer(blob, dtype=np.uint8), qt).astype(np.float64)
        ref = float(np.dot(w, a.astype(np.float64)))
        check(abs(ours - ref) <= 1e-12 * np.abs(w * a).sum(), f"dot {name}: {ours} vs {ref}")
    print(f"dot: {len(BLOCK_TYPES)} types, rows of {n}, equal to float64 dots of gguf's dequantization")


if not os.path.exists(HARNESS):
    sys.exit(f"FAIL: {HARNESS} not built (make tests/quant_harness)")
test_dequant()
test_quantize_legacy()
test_quantize_k()
test_dot()
if failures:
    print(f"FAIL: {len(failures)} check(s) failed")
    sys.exit(1)
print("PASS")
