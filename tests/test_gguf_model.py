"""test_gguf_model.py: GGUF models read directly, their quantized weights kept quantized, against
transformers + peft running the same weights dequantized by the `gguf` package (GGUF's reference
Python), in float32.

Each checkpoint is a random transformers model (Llama, Mistral-as-llama, Qwen2, Qwen3) written as
a GGUF file the way llama.cpp's converter writes one: metadata keys {arch}.*, Q and K rows of a
"llama" permuted for interleaved-pair RoPE, norms and biases F32, matrices quantized per tensor
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 by gguf.quants.quantize; Q4_K, Q5_K, Q6_K by our quantizer, since
gguf has none: their bytes are then read back by gguf's dequantizer for the reference). The
reference model's weights are gguf's dequantization of those bytes, rows put back in Hugging Face
order by this test. The engine computes in F32 on the same values (its kernels fuse s*q + o where
the reference rounds twice: a weight moves by at most one F32 ulp), so the F32 tolerance of
test_ref_forward.py holds: every position's log-softmax within 1e-4, greedy continuation equal
(or a genuine tie). A LoRA adapter from peft on top of the quantized base is held to the same.
Bad files are refused with a message naming what is wrong."""
import math
import os
import subprocess
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

try:
    import gguf  # noqa: E402
    from gguf import GGMLQuantizationType as QT  # noqa: E402
except ImportError:
    print("SKIP: the gguf package is not installed")
    sys.exit(77)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import ALL_PROJ, VOCAB, make_adapter, make_model  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()

HARNESS = os.path.join(reflib.BUILDDIR, "tests", "quant_harness")
OURS = {QT.Q4_K: "Q4_K", QT.Q5_K: "Q5_K", QT.Q6_K: "Q6_K"}


def quantize(w, qt):
    """(rows, cols) float32 -> the tensor's bytes as the writer takes them (and its type)"""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qt == QT.F32:
        return w
    if qt == QT.F16:
        return w.astype(np.float16)
    if qt in OURS:
        p = subprocess.run([HARNESS, "quantize", OURS[qt], str(w.size)], input=w.tobytes(), capture_output=True)
        if p.returncode:
            reflib.fail(f"quant_harness quantize {OURS[qt]}: {p.stderr.decode()}")
        return np.frombuffer(p.stdout, dtype=np.uint8).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qt)


def dequantize(b, qt):
    if qt in (QT.F32, QT.F16):
        return np.asarray(b, dtype=np.float32)
    return gguf.quants.dequantize(b, qt).astype(np.float32)


def permute(w, n_head):
    """llama.cpp's converter: HF row h*hd + s*hd/2 + i goes to h*hd + 2i + s"""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight|bias
    layer, mod, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{GGUF_NAMES[mod]}.{kind}"


def write_gguf(ref, kind, types, path, permute_qk=True, tensor_hook=None, omit=(), extra_tensors=None):
    """Write REF (a transformers model) as a GGUF at PATH, matrices quantized by
    types(gguf_name) -> QT; returns the reference model on the dequantized weights."""
    cfg = ref.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[kind]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if "head_count_kv" not in omit:
        w.add_head_count_kv(cfg.num_key_value_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if "key_length" not in omit:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    w.add_rope_freq_base(float(theta))
    # tokens without a tokenizer model: the vocabulary's size, and no tokenizer (prompts as ids)
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    tied = cfg.tie_word_embeddings
    deq = {}
    for name, t in sd.items():
        if tied and name == "lm_head.weight":
            continue
        g = gguf_name(name)
        if t.ndim == 2:
            qt = types(g)
            x = t
            heads = cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads
            perm = arch == "llama" and (".attn_q." in g or ".attn_k." in g)
            if perm and permute_qk:
                x = permute(x, heads)
            b = quantize(x, qt)
            d = dequantize(b, qt).reshape(t.shape)
            if perm:
                d = unpermute(d, heads)
            deq[name] = d
            if tensor_hook:
                b, qt = tensor_hook(g, b, qt)
            if qt in (QT.F32, QT.F16):
                w.add_tensor(g, b)
            else:
                w.add_tensor(g, b, raw_shape=b.shape, raw_dtype=qt)
        else:
            x = t
            if arch == "llama" and (".attn_q." in g or ".attn_k." in g) and permute_qk:
                x = permute(x, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
            deq[name] = t
            w.add_tensor(g, np.ascontiguousarray(x, dtype=np.float32))
    for g, x in (extra_tensors or {}).items():
        w.add_tensor(g, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = type(ref)(cfg).eval()
    with torch.no_grad():
        sd2 = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in deq.items()}
        if tied:
            sd2["lm_head.weight"] = sd2["model.embed_tokens.weight"]
        out.load_state_dict(sd2, strict=True)
    return out


def act_quantize(x, block):
    """--precision int8's activations, as llama.cpp's Q8_0 (BLOCK 32) and Q8_K (BLOCK 256) blocks
    hold them: per BLOCK elements of the last dim, values x * id rounded to nearest even
    (torch.round), id = 127 / max|x|; the scale max|x| / 127 rounded to float16 per 32, 1 / id in
    float32 per 256"""
    shp = x.shape
    xb = x.reshape(-1, shp[-1] // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    idv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * idv).clamp(-127, 127)
    if block == 32:
        d = (amax / 127.0).half().float()
    else:
        d = torch.where(amax > 0, 1.0 / idv, torch.zeros_like(amax))
    return (q * d).reshape(shp)


# per position of the last forward through an int8 reference: the least distance, in rounding
# steps, of any of its 8-bit activations from a rounding boundary (x * id at k + 1/2)
NEAR = {}
# closer than this to a boundary, the two sides' F32 ulps can round a value apart: 6.5 ulps of
# 127 (a flip was seen at 7.6e-6, one ulp)
NEAR_STEPS = 5e-5
# what one step's flip moves the later logprobs by in these models is 5e-2 to 1e-1
FLIP_BOUND = 0.5


def held_until_near():
    """(positions before the first within NEAR_STEPS of a rounding boundary, FLIP_BOUND)"""
    m = NEAR["min"]
    near = (m < NEAR_STEPS).nonzero()
    return (int(near[0]) if len(near) else int(m.shape[0]), FLIP_BOUND)


def near_boundary(x, block):
    xb = x.reshape(x.shape[0], x.shape[1], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    idv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = (xb * idv).abs().double()
    dist = (v - v.floor() - 0.5).abs()
    dist = torch.where(xb == 0, torch.ones_like(dist), dist)
    m = dist.reshape(x.shape[0], x.shape[1], -1).amin(dim=-1)[0]
    prev = NEAR.get("min")
    NEAR["min"] = m if prev is None or prev.shape != m.shape else torch.minimum(prev, m)


def int8_reference(ref, types):
    """REF with every quantized Linear's input replaced by its 8-bit quantization (per 256 before
    a K type, per 32 before the others), as --precision int8 computes; F32/F16 weights exact"""
    def hook(block):
        def f(mod, args):
            near_boundary(args[0], block)
            return (act_quantize(args[0], block),)
        return f
    for name, mod in ref.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        hf = name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
        g = gguf_name(hf if hf.startswith(("model.", "lm_head")) else "model." + hf)
        qt = types(g)
        if qt in (QT.F32, QT.F16):
            continue
        mod.register_forward_pre_hook(hook(256 if qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 32))
    return ref


def prompts(name, lengths=(1, 9, 120)):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]


TOL = 1e-4
worst = {}


def check(name, ref, path, lora=None, extra=(), lengths=(1, 9, 120), held=None):
    for p in prompts(name, lengths):
        NEAR.clear()
        wv = reflib.compare(f"{name} [len {len(p)}]", ref, path, p, 12, TOL, lora_dir=lora, extra=extra, held=held)
        worst[name] = max(worst.get(name, 0), wv)


def llama3_rope_factors(theta, dim, rs):
    """rope_freqs.weight as llama.cpp's converter writes it for rope_scaling "llama3": per
    frequency the divisor that turns the plain frequency into the scaled one (1 above the
    high-frequency wavelength, factor below the low one, smoothed between)"""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, lo, hi, factor = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(1.0)
        elif wl > old / lo:
            out.append(factor)
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def refused(path, *words):
    p = subprocess.run([reflib.CARASERVE, "generate", "--model", path, "--prompt-ids", "1,2,3", "--max-tokens", "1"],
                       capture_output=True, text=True)
    if p.returncode == 0:
        reflib.fail(f"{path}: accepted, expected a refusal mentioning {words}")
    for wd in words:
        if wd not in p.stderr:
            reflib.fail(f"{path}: refusal does not mention {wd!r}:\n{p.stderr}")
    print(f"ok  refused: {p.stderr.strip().splitlines()[-1][:160]}")


def main():
    if not os.path.exists(HARNESS):
        reflib.fail(f"{HARNESS} is not built")
    tmp = reflib.tmpdir("cs_gguf_")

    # the 32-element types, each on every matrix, on a small Llama with GQA (Q/K permuted)
    _, llama = make_model("llama", heads=4, kv_heads=2, hidden=64, inter=96)
    refs = {}
    for qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        path = os.path.join(tmp, f"llama-{qt.name}.gguf")
        refs[qt] = write_gguf(llama, "llama", lambda g, qt=qt: qt, path)
        check(f"llama {qt.name}", refs[qt], path)

    # Llama 3.1-style RoPE: transformers' rope_scaling "llama3" against the GGUF's
    # rope_freqs.weight (no scaling in its metadata), frequencies in all three regimes
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    _, l31 = make_model("llama", heads=4, kv_heads=2, hidden=64, inter=96, rope_scaling=rs)
    ff = llama3_rope_factors(10000.0, 16, rs)
    if not (ff[0] == 1 and ff[-1] == 8 and any(1 < x < 8 for x in ff)):
        reflib.fail(f"rope factors {ff}: not every regime")
    path31 = os.path.join(tmp, "llama31.gguf")
    ref31 = write_gguf(l31, "llama", lambda g: QT.Q8_0, path31, extra_tensors={"rope_freqs.weight": ff})
    check("llama Q8_0 rope_freqs (llama3 scaling)", ref31, path31)
    # the same file without the factors is another model: the check can fail
    path31b = os.path.join(tmp, "llama31-nofactors.gguf")
    write_gguf(l31, "llama", lambda g: QT.Q8_0, path31b)
    p = prompts("rope")[2]
    rows, _ = reflib.run_engine(path31b, p, 0)
    d = float(np.abs(reflib.log_softmax64(rows) - reflib.log_softmax64(reflib.hf_logits(ref31, p))).max())
    if not d > 1e-2:
        reflib.fail(f"without rope_freqs.weight the engine is within {d:.2e} of the llama3-scaled reference")
    print(f"ok  without rope_freqs.weight: {d:.2e} from the llama3-scaled reference")
    bad = os.path.join(tmp, "llama31-bad.gguf")
    write_gguf(l31, "llama", lambda g: QT.Q8_0, bad, extra_tensors={"rope_freqs.weight": np.concatenate([ff, ff])})
    refused(bad, "rope_freqs.weight", "F32 of 8 elements")
    bad0 = os.path.join(tmp, "llama31-zero.gguf")
    write_gguf(l31, "llama", lambda g: QT.Q8_0, bad0, extra_tensors={"rope_freqs.weight": np.zeros_like(ff)})
    refused(bad0, "rope_freqs.weight[0]", "> 0")

    # a Q4_K_M-like mix on rows of 256: Q4_K, Q6_K on attn_v / ffn_down / output, Q5_K, F16
    _, big = make_model("llama", heads=4, kv_heads=2, hidden=256, inter=512)

    def mix(g):
        if g == "output.weight" or ".attn_v." in g or ".ffn_down." in g:
            return QT.Q6_K
        if ".ffn_up." in g:
            return QT.Q5_K
        if g == "token_embd.weight":
            return QT.Q8_0
        return QT.Q4_K
    path_mix = os.path.join(tmp, "llama-mix.gguf")
    ref_mix = write_gguf(big, "llama", mix, path_mix)
    check("llama K-mix", ref_mix, path_mix)
    # the same on the reference kernels (the fast ones against these: tests/test_cpu_kernels.c)
    check("llama K-mix --reference-kernels", ref_mix, path_mix, extra=("--reference-kernels",), lengths=(9,))

    # --precision int8: the activations of every quantized matmul rounded to 8 bits, against
    # transformers with the same rounding hooked in front of those Linears. The rounding is a
    # step function: where the two sides compute an activation an F32 ulp apart across a
    # rounding boundary, one value moves by a whole step (max|x| / 127), and in this random
    # model that moves the later logprobs by 5e-2 to 1e-1 (torch against itself with its
    # embeddings scaled by 1 + 1e-6 noise does the same from the 12th position of a 120-token
    # prompt). So the sequences here are short (up to 21 positions), and the reference records,
    # per position, how close its activations come to a rounding boundary: every position before
    # the first with one within NEAR_STEPS is held to the F32 tolerance (1e-4), the later ones
    # (a flip's, carried on by the KV cache) within FLIP_BOUND.
    # The kernels on the repacked Q8_0/Q4_K/Q5_K/Q6_K weights (AVX512-VNNI, and AVX2 with the same
    # bits) sum the same integers in another F32 order, which moves where such near-boundary
    # values fall (on these prompts one does, at one position: 9e-2): the check runs on the
    # int8 kernels over the weights' own blocks (CS_NO_QPACK), and the packs' kernels are held
    # to the plain int8 loop, which these match here, at 1e-5 in tests/test_cpu_kernels.c
    # (test_quant_int8_pack).
    for name, r, types, path in (("llama K-mix", ref_mix, mix, path_mix),
                                 ("llama Q4_1", refs[QT.Q4_1], lambda g: QT.Q4_1, os.path.join(tmp, "llama-Q4_1.gguf"))):
        r8 = int8_reference(r, types)
        os.environ["CS_NO_QPACK"] = "1"
        try:
            check(f"{name} --precision int8", r8, path, extra=("--precision", "int8"), lengths=(1, 9), held=held_until_near)
        finally:
            del os.environ["CS_NO_QPACK"]
        # and the rounding matters: the exact engine is far from that reference
        p = prompts(name)[1]
        rows, _ = reflib.run_engine(path, p, 0)
        d = float(np.abs(reflib.log_softmax64(rows) - reflib.log_softmax64(reflib.hf_logits(r8, p))).max())
        if not d > 1e-3:
            reflib.fail(f"{name}: the exact engine is within {d:.2e} of the int8 reference: the check proves nothing")
        print(f"ok  {name}: the exact engine is {d:.2e} from the int8 reference (the rounding is exercised)")
        for mod in r.modules():  # the hooks off again
            mod._forward_pre_hooks.clear()

    # Qwen2 (q/k/v biases, not permuted), Qwen3 (q/k norms, head_dim 64 over hidden 128), tied
    _, qwen2 = make_model("qwen2", heads=4, kv_heads=2, hidden=128, inter=160, tied=True)
    path = os.path.join(tmp, "qwen2.gguf")
    check("qwen2 Q8_0 tied", write_gguf(qwen2, "qwen2", lambda g: QT.Q8_0, path), path)
    _, qwen3 = make_model("qwen3", heads=4, kv_heads=2, hidden=128, head_dim=64, inter=160)
    path = os.path.join(tmp, "qwen3.gguf")
    check("qwen3 Q5_0/F16", write_gguf(qwen3, "qwen3", lambda g: QT.F16 if "ffn" in g else QT.Q5_0, path), path)

    # --quantization at load from a Hugging Face directory (BF16 weights): the projections
    # quantized (Q8_0 by the same bytes as gguf.quants.quantize, the K types by our quantizer
    # through the harness) and read back by gguf's dequantizer for the reference; the embedding,
    # lm_head and norms as they are. A BF16 model of hidden 256 and intermediate 320: the down
    # projection's rows of 320 are not whole Q4_K blocks and take Q5_0, as llama.cpp's do.
    hf_dir, hf = make_model("llama", heads=4, kv_heads=2, hidden=256, inter=320, dtype="bfloat16")
    for qname, qt in (("q8_0", QT.Q8_0), ("q4_k", QT.Q4_K), ("q6_k", QT.Q6_K)):
        ref = type(hf)(hf.config).eval()
        sd = {}
        for k, v in hf.state_dict().items():
            t = v.detach().float().numpy()
            if any(p + ".weight" in k for p in ALL_PROJ):
                q = qt if t.shape[1] % 256 == 0 or qt == QT.Q8_0 else {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}[qt]
                t = dequantize(quantize(t, q), q).reshape(t.shape)
            sd[k] = torch.from_numpy(np.ascontiguousarray(t))
        ref.load_state_dict(sd, strict=True)
        check(f"BF16 directory --quantization {qname}", ref, hf_dir, extra=("--quantization", qname), lengths=(1, 40))
        p = prompts(qname)[2]
        rows, _ = reflib.run_engine(hf_dir, p, 0)  # without the flag: the BF16 weights
        d = float(np.abs(reflib.log_softmax64(rows) - reflib.log_softmax64(reflib.hf_logits(ref, p))).max())
        if not d > 1e-4:
            reflib.fail(f"--quantization {qname}: the unquantized engine is within {d:.2e} of the quantized reference")
        print(f"ok  without --quantization {qname} the engine is {d:.2e} from that reference (the flag is exercised)")
    p = subprocess.run([reflib.CARASERVE, "generate", "--model", hf_dir, "--prompt-ids", "1", "--quantization", "fp8"],
                       capture_output=True, text=True)
    if p.returncode != 2 or "--quantization wants none, q8_0" not in p.stderr:
        reflib.fail(f"--quantization fp8: exit {p.returncode}, {p.stderr!r}")
    print("ok  --quantization fp8: exit 2,", p.stderr.strip().splitlines()[0])

    # keys llama.cpp's converter may leave out take llama.cpp's defaults (KV heads = heads,
    # head_dim = hidden / heads), not transformers' per-architecture ones (Qwen2's 32 KV heads)
    _, q2 = make_model("qwen2", heads=4, kv_heads=4, hidden=64, inter=96)
    path = os.path.join(tmp, "qwen2-nokv.gguf")
    check("qwen2 without head_count_kv/key_length", write_gguf(q2, "qwen2", lambda g: QT.Q8_0, path,
                                                               omit=("head_count_kv", "key_length")), path, lengths=(9,))

    # LoRA on the quantized base: peft's adapter on the dequantized weights
    deq_dir = reflib.tmpdir("cs_gguf_deq_")
    ref_mix.save_pretrained(deq_dir, safe_serialization=True)
    lora_dir, peft_ref = make_adapter(deq_dir, ref_mix, r=16, alpha=32, targets=ALL_PROJ, seed=5)
    check("llama K-mix + LoRA r16", peft_ref, path_mix, lora=lora_dir)

    # the permutation matters: a llama file written without it must disagree with the model
    # (rows are quantized one by one, so the same values as the Q8_0 file's, moved)
    path = os.path.join(tmp, "llama-noperm.gguf")
    write_gguf(llama, "llama", lambda g: QT.Q8_0, path, permute_qk=False)
    rows, _ = reflib.run_engine(path, prompts("noperm")[2], 0)
    lp = reflib.log_softmax64(rows)
    lr = reflib.log_softmax64(reflib.hf_logits(refs[QT.Q8_0], prompts("noperm")[2]))
    diff = float(np.abs(lp - lr).max())
    if not diff > 1e-2:
        reflib.fail(f"un-permuted Q/K rows gave the same logprobs ({diff:.2e}): the permutation is not exercised")
    print(f"ok  a llama GGUF without the Q/K permutation differs by {diff:.2e} (the permutation is exercised)")

    # refusals
    def iq4(g, b, qt):  # one matrix in a type nothing computes with (same bytes per block as Q4_0)
        return (b, QT.IQ4_NL) if g == "blk.0.ffn_up.weight" else (b, qt)
    path = os.path.join(tmp, "iq4.gguf")
    write_gguf(llama, "llama", lambda g: QT.Q4_0, path, tensor_hook=iq4)
    refused(path, "blk.0.ffn_up.weight", "IQ4_NL", "not supported")

    path = os.path.join(tmp, "phi.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    refused(path, "phi3", "not supported")

    path = os.path.join(tmp, "trunc.gguf")
    with open(path_mix, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 1000])
    refused(path, "trunc.gguf")

    # a file whose metadata says 3 layers over tensors for 2
    path = os.path.join(tmp, "two.gguf")
    write_gguf(llama, "llama", lambda g: QT.Q8_0, path)
    path3 = os.path.join(tmp, "lying.gguf")
    r = gguf.GGUFReader(path)
    wr = gguf.GGUFWriter(path3, "llama")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        val = field.contents()
        if field.name == "llama.block_count":
            val = 3
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            wr.add_key_value(field.name, val, vt, sub_type=field.types[-1])
        else:
            wr.add_key_value(field.name, val, vt)
    for t in r.tensors:
        wr.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape, raw_dtype=t.tensor_type)
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
    refused(path3, "blk.2.")

    print("worst |dlogprob| per case:", {k: f"{v:.2e}" for k, v in worst.items()})
    print("PASS")


if __name__ == "__main__":
    main()
