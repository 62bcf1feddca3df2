"""test_ref_bf16.py: `--precision bf16` against transformers run in bfloat16, and a BF16 KV
cache (`--kv-cache-dtype bf16`) under the exact mode against transformers in float32 whose
attention reads K and V rounded to bfloat16.

In the bf16 mode every matmul against BF16 weights takes its input rounded to BF16 (nearest
even) and sums the exact products in F32, as PyTorch's BF16 GEMMs do, and the KV cache holds
K (after RoPE) and V rounded to BF16 (--kv-cache-dtype auto), as a BF16 model's cache does;
everything else (norms, RoPE, attention's sums, softmax, LoRA, the residual stream) stays
F32. Two references:

  - transformers run in bfloat16 (torch_dtype=torch.bfloat16), which also rounds every
    activation between ops to BF16: within BF16_TOL, stated from the measured distances;
  - that definition in PyTorch, transformers + peft in float32 with a forward pre-hook on
    every base nn.Linear (not LoRA's A and B) rounding its input to bfloat16, and K and V
    rounded where attention reads them (kv_rounded below): printed, not
    asserted end to end. Rounding to BF16 is discontinuous: where an activation lies within
    F32 summation noise of a BF16 rounding boundary, the two sides round it apart by one BF16
    step (2^-8 relative), and through attention that moves every later position by ~1e-2 on
    these models (seen: rows equal to 5e-7 up to such a flip, then 3e-3 to 2e-2). Which
    activations flip depends on each CPU's summation order, so the definition is held per
    matmul instead, against the plain reference on the rounded input, on every kernel path
    (tests/test_cpu_kernels.c: test_gemm_dpbf16, test_matmul_precision_bf16).

For BF16 checkpoints (base and adapter), at every position of prompts of 7..300 tokens and
an 8-token greedy continuation, also:

  - caraserve bf16 is no further from transformers' float32 than transformers' own bfloat16
    is (the mode loses less than PyTorch's BF16 does);
  - the mode is not a no-op: it moves logprobs away from the exact default by > 1e-4, and
    the exact default stays within 1e-3 of float32 on the same files.

The BF16 KV cache alone (exact matmuls): every position's logprobs within KV_TOL of
transformers + peft in float32 with K (after RoPE) and V rounded to bfloat16 (the same
definition; rounding flips are rare here, as K and V are rounded once, not fed through every
matmul), and moved from the F32 cache's by more than 1e-5 (not a no-op).

The measured numbers are printed per case."""
import contextlib
import importlib
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import VOCAB, make_adapter, make_model  # noqa: E402
from peft import PeftModel  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()

# caraserve bf16 vs transformers bf16: both round matmul inputs to BF16; transformers also
# rounds every activation between ops, which is most of the difference (measured: see the
# printed table; the worst case in this file is about a third of this)
BF16_TOL = 0.5
# caraserve exact + BF16 KV cache vs float32 torch with K and V rounded to bfloat16: both read
# the same rounded K and V; the rest is F32 summation order, plus a rare K or V element that
# F32 noise rounds to the other BF16 neighbour (measured: see the printed table)
KV_TOL = 2e-3
ls = reflib.log_softmax64
rows_out = []


def bf16_model(d, cls, lora=None):
    m = cls.from_pretrained(d, torch_dtype=torch.bfloat16, attn_implementation="eager")
    if lora:
        m = PeftModel.from_pretrained(m, lora, torch_dtype=torch.bfloat16)
    return m.eval().to(torch.bfloat16)


def round_linear_inputs(model):
    """float32 model whose base linears see their input rounded to bfloat16 (what
    --precision bf16 defines); LoRA's own linears (lora_A, lora_B) keep F32 inputs"""
    import copy
    m = copy.deepcopy(model)
    hooked = 0
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
            mod.register_forward_pre_hook(lambda _m, args: (args[0].to(torch.bfloat16).to(torch.float32),) + args[1:])
            hooked += 1
    assert hooked > 0
    return m


@contextlib.contextmanager
def kv_rounded(model):
    """MODEL's attention reads K (after RoPE) and V rounded to bfloat16, what a BF16 KV
    cache holds: RoPE's output K and each v_proj's output (LoRA included) rounded"""
    mods = [importlib.import_module(f"transformers.models.{a}.modeling_{a}") for a in ("llama", "qwen3")]
    saved = [m.apply_rotary_pos_emb for m in mods]

    def wrap(f):
        def rope(q, k, *a, **kw):
            q, k = f(q, k, *a, **kw)
            return q, k.to(torch.bfloat16).to(k.dtype)
        return rope
    hooks = [mod.register_forward_hook(lambda _m, _i, o: o.to(torch.bfloat16).to(o.dtype))
             for name, mod in model.named_modules() if name.endswith("self_attn.v_proj")]
    assert hooks
    try:
        for m, f in zip(mods, saved):
            m.apply_rotary_pos_emb = wrap(f)
        yield model
    finally:
        for m, f in zip(mods, saved):
            m.apply_rotary_pos_emb = f
        for h in hooks:
            h.remove()


def check(name, ref32, d, cls, lora=None, lengths=(7, 100, 300), gen=8):
    ref16 = bf16_model(d, cls, lora)
    refdef = round_linear_inputs(ref32)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for n in lengths:
        p = [int(t) for t in rng.integers(3, VOCAB, size=n)]
        rows, out = reflib.run_engine(d, p, gen, lora_dir=lora, extra=("--precision", "bf16"))
        exact, _ = reflib.run_engine(d, p + out[:-1], 0, lora_dir=lora)
        full = p + out[:-1]
        l16, l32 = ls(reflib.hf_logits(ref16, full)), ls(reflib.hf_logits(ref32, full))
        with kv_rounded(refdef):
            ldef = ls(reflib.hf_logits(refdef, full))
        ours, ex = ls(rows), ls(exact)
        if ours.shape != l16.shape or ex.shape != l16.shape:
            reflib.fail(f"{name}: rows {ours.shape} / {ex.shape} vs reference {l16.shape}")
        e16 = float(np.abs(ours - l16).max())
        rowdef = np.abs(ours - ldef).max(axis=1)
        edef = float(rowdef.max())
        first = int(np.argmax(rowdef > 1e-4)) if (rowdef > 1e-4).any() else len(rowdef)
        e_ours32 = float(np.abs(ours - l32).max())
        e_hf = float(np.abs(l16 - l32).max())
        moved = float(np.abs(ours - ex).max())
        e_exact = float(np.abs(ex - l32).max())
        case = f"{name} [len {n}]"
        rows_out.append((case, edef, e16, e_ours32, e_hf, moved))
        if not e16 <= BF16_TOL:
            reflib.fail(f"{case}: |caraserve bf16 - transformers bf16| {e16:.3g} > {BF16_TOL}")
        if not e_ours32 <= e_hf:
            reflib.fail(f"{case}: caraserve bf16 is {e_ours32:.3g} from float32, transformers bf16 only {e_hf:.3g}")
        if not moved > 1e-4:
            reflib.fail(f"{case}: --precision bf16 changed logprobs by only {moved:.3g}: the mode did nothing")
        if not e_exact <= 1e-3:
            reflib.fail(f"{case}: the exact default is {e_exact:.3g} from float32")
        print(f"ok  {case}: vs its definition in torch {edef:.2e} (rows 0..{first - 1} within 1e-4), vs transformers bf16 {e16:.2e} (tol {BF16_TOL}); from float32: caraserve bf16 "
              f"{e_ours32:.2e}, transformers bf16 {e_hf:.2e}; bf16 vs exact {moved:.2e}")


kv_rows = []


def check_kv(name, ref32, d, lora=None, lengths=(7, 300), gen=8):
    """exact matmuls, BF16 KV cache: against float32 torch reading rounded K and V"""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    for n in lengths:
        p = [int(t) for t in rng.integers(3, VOCAB, size=n)]
        rows, out = reflib.run_engine(d, p, gen, lora_dir=lora, extra=("--kv-cache-dtype", "bf16"))
        full = p + out[:-1]
        f32, _ = reflib.run_engine(d, full, 0, lora_dir=lora)
        with kv_rounded(ref32):
            lkv = ls(reflib.hf_logits(ref32, full))
        l32 = ls(reflib.hf_logits(ref32, full))
        ours = ls(rows)
        if ours.shape != lkv.shape:
            reflib.fail(f"{name}: rows {ours.shape} vs reference {lkv.shape}")
        ekv = float(np.abs(ours - lkv).max())
        moved = float(np.abs(ours - ls(f32)).max())
        e32 = float(np.abs(ours - l32).max())
        case = f"{name} [len {n}]"
        kv_rows.append((case, ekv, e32, moved))
        if not ekv <= KV_TOL:
            reflib.fail(f"{case}: |caraserve BF16 KV - torch with rounded K, V| {ekv:.3g} > {KV_TOL}")
        if not moved > 1e-5:
            reflib.fail(f"{case}: --kv-cache-dtype bf16 changed logprobs by only {moved:.3g}: the cache is not BF16")
        print(f"ok  {case}: BF16 KV vs torch with rounded K, V {ekv:.2e} (tol {KV_TOL}); vs plain float32 {e32:.2e}; "
              f"vs the F32 cache {moved:.2e}")


L = transformers.LlamaForCausalLM
d, ref = make_model("llama", "bfloat16", tied=True, heads=8, kv_heads=2, hidden=128, inter=344, layers=3)
check("llama bf16 tied GQA", ref, d, L)
a, aref = make_adapter(d, ref, r=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], seed=5,
                       dtype="bfloat16")
check("llama bf16 + bf16 lora r16", aref, d, L, lora=a, lengths=(33, 300))
d, ref = make_model("qwen3", "bfloat16", heads=4, kv_heads=2, head_dim=32, hidden=128, inter=256, layers=2)
check("qwen3 bf16 qk-norm", ref, d, transformers.Qwen3ForCausalLM, lengths=(9, 200))
check_kv("qwen3 bf16 qk-norm", ref, d)
d, ref = make_model("llama", "float32", heads=8, kv_heads=2, hidden=128, inter=344, layers=3)
check_kv("llama f32 GQA", ref, d)
a, aref = make_adapter(d, ref, r=8, alpha=16, targets=["k_proj", "v_proj", "o_proj"], seed=9)
check_kv("llama f32 + lora r8 on k, v", aref, d, lora=a, lengths=(40,))

print("case | vs torch with BF16 linear inputs | vs transformers bf16 | from float32: caraserve bf16 | "
      "transformers bf16 | bf16 vs exact")
for case, edef, e16, e32, ehf, mv in rows_out:
    print(f"  {case}: {edef:.2e} | {e16:.2e} | {e32:.2e} | {ehf:.2e} | {mv:.2e}")
print("exact + BF16 KV case | vs torch with rounded K, V | vs float32 | vs the F32 cache")
for case, ekv, e32, mv in kv_rows:
    print(f"  {case}: {ekv:.2e} | {e32:.2e} | {mv:.2e}")
print("PASS")
