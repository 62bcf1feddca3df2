"""test_ref_forward.py: the C engine against transformers + peft themselves.

Checkpoints are random-initialised LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM written by transformers' save_pretrained (F32 and BF16, tied and untied,
GQA, Llama-3 rope scaling, sliding window, explicit head_dim), adapters by peft's
save_pretrained (lora_B made non-zero; several ranks, rsLoRA, partial targets, rank and
alpha patterns), plus files written by caraserve-mkmodel. For every position of prompts of
1..300 tokens and a 16-token greedy continuation, log-softmax must agree within 1e-4 (F32
weights) or 1e-3 (BF16 weights). The reference runs in float32 (BF16 weights upcast
exactly), i.e. the math our engine claims: BF16 storage, F32 compute."""
import os
import subprocess
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

def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]


worst = {}


def check(name, ref, d, tol, lengths=(1, 7, 300), lora=None, gen=16, extra=()):
    for i, p in enumerate(prompts(zlib.crc32(name.encode()), lengths)):  # stable across runs
        w = reflib.compare(f"{name} [len {len(p)}]", ref, d, p, gen, tol, lora_dir=lora, extra=extra)
        worst[name] = max(worst.get(name, 0), w)


F32, BF16 = 1e-4, 1e-3


def must_matter(name, ref, d, mutate, lora=None, length=200):
    """The feature under test must change the result: with it removed from the files, the
    engine has to disagree with the reference (else the check above proved nothing)."""
    import json, shutil
    m = reflib.tmpdir("cs_mut_")
    for f in os.listdir(d):
        shutil.copy(os.path.join(d, f), m)
    if lora is not None:
        lm = reflib.tmpdir("cs_mut_lora_")
        for f in os.listdir(lora):
            shutil.copy(os.path.join(lora, f), lm)
        mutate(lm)
    else:
        lm = None
        mutate(m)
    p = prompts(7, [length])[0]
    rows, gen = reflib.run_engine(m if lora is None else d, p, 0, lora_dir=lm)
    ref_rows = reflib.hf_logits(ref, p)
    diff = float(np.abs(reflib.log_softmax64(rows) - reflib.log_softmax64(ref_rows)).max())
    if diff < 1e-2:
        reflib.fail(f"{name}: removing the feature changed logprobs by only {diff:.3g}: the test is not sensitive")
    print(f"ok  {name}: without it the engine is off by {diff:.3g}")


def edit_json(path, fn):
    import json
    with open(path) as f:
        c = json.load(f)
    fn(c)
    with open(path, "w") as f:
        json.dump(c, f)


def drop_rope_scaling(c):
    c.pop("rope_scaling", None)
    if isinstance(c.get("rope_parameters"), dict):
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_parameters"].get("rope_theta", 10000.0)}


def zero_scale_lora(dirpath):
    edit_json(os.path.join(dirpath, "adapter_config.json"), lambda c: c.update(lora_alpha=0, alpha_pattern={}))

# ---- base models ----
d, ref = make_model("llama", "float32", tied=False, heads=4, kv_heads=4)
check("llama f32 untied MHA", ref, d, F32)
a, aref = make_adapter(d, ref, r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
check("llama f32 + lora r8 all targets", aref, d, F32, lora=a)
must_matter("the r8 adapter", aref, d, zero_scale_lora, lora=a)
a, aref = make_adapter(d, ref, r=16, alpha=8, targets=["q_proj", "v_proj"], rslora=True, seed=3)
check("llama f32 + lora r16 rslora q,v", aref, d, F32, lora=a, lengths=(5, 120))
a, aref = make_adapter(d, ref, r=4, alpha=8, targets=["o_proj", "gate_proj", "up_proj", "down_proj"], seed=4,
                       rank_pattern={"model.layers.0.mlp.down_proj": 12, "o_proj": 6},
                       alpha_pattern={"up_proj": 3, "model.layers.1.mlp.gate_proj": 32})
check("llama f32 + lora rank/alpha patterns", aref, d, F32, lora=a, lengths=(9, 64))
must_matter("the alpha pattern", aref, d, lambda l: edit_json(os.path.join(l, "adapter_config.json"), lambda c: c.update(alpha_pattern={})), lora=a)

d, ref = make_model("llama", "bfloat16", tied=True, heads=8, kv_heads=2,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
check("llama bf16 tied GQA llama3-rope", ref, d, BF16)
must_matter("llama3 rope scaling", ref, d, lambda m: edit_json(os.path.join(m, "config.json"), drop_rope_scaling))
a, aref = make_adapter(d, ref, r=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=5, dtype="bfloat16")
check("llama bf16 + bf16 lora r16", aref, d, BF16, lora=a, lengths=(33, 300))

d, ref = make_model("mistral", "float32", heads=8, kv_heads=2, sliding_window=48)
check("mistral f32 GQA sliding-window 48", ref, d, F32, lengths=(1, 47, 300))
must_matter("the sliding window", ref, d, lambda m: edit_json(os.path.join(m, "config.json"), lambda c: c.update(sliding_window=None)))
a, aref = make_adapter(d, ref, r=64, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=6)
check("mistral f32 + lora r64", aref, d, F32, lora=a, lengths=(20, 200))

d, ref = make_model("qwen2", "float32", tied=True, heads=4, kv_heads=2)
check("qwen2 f32 tied q/k/v bias", ref, d, F32)
a, aref = make_adapter(d, ref, r=8, alpha=16, targets=["k_proj", "v_proj", "up_proj"], seed=7)
check("qwen2 f32 + lora r8 k,v,up", aref, d, F32, lora=a, lengths=(30,))

d, ref = make_model("qwen3", "bfloat16", heads=4, kv_heads=2, head_dim=32)
check("qwen3 bf16 qk-norm head_dim 32", ref, d, BF16)
a, aref = make_adapter(d, ref, r=8, alpha=16, targets=["q_proj"], rslora=True, seed=9)
must_matter("rsLoRA scaling", aref, d, lambda l: edit_json(os.path.join(l, "adapter_config.json"), lambda c: c.update(use_rslora=False)), lora=a)
d, ref = make_model("qwen3", "float32", heads=4, kv_heads=1, head_dim=24, layers=3)
check("qwen3 f32 MQA head_dim 24", ref, d, F32, lengths=(2, 150))
a, aref = make_adapter(d, ref, r=32, alpha=64, targets="all-linear", seed=8)
check("qwen3 f32 + lora r32 all-linear", aref, d, F32, lora=a, lengths=(40,))

# ---- --compress-weights: every decode step reads the BF16 weights coded in 12 bits ----
# hidden 160 and intermediate 352: rows of 2.5 and 5.5 blocks of 64 (the partial block's
# tail), GQA, untied (the lm_head coded on its own); 48 decode steps each
CW = ("--compress-weights",)
d, ref = make_model("llama", "bfloat16", tied=False, heads=4, kv_heads=2, hidden=160, inter=352, seed=11)
check("llama bf16 hidden 160 --compress-weights", ref, d, BF16, lengths=(3, 64), gen=48, extra=CW)
a, aref = make_adapter(d, ref, r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=12, dtype="bfloat16")
check("llama bf16 hidden 160 + bf16 lora --compress-weights", aref, d, BF16, lora=a, lengths=(9,), gen=48, extra=CW)
st = subprocess.run([reflib.CARASERVE, "generate", "--model", d, "--prompt-ids", "5,6,7", "--max-tokens", "2", "--stats",
                     *CW], capture_output=True, text=True, check=True).stderr
import re  # noqa: E402
avx = "avx512" in st or "avx2" in st
if avx and not ("+wc12" in st and re.search(r"coded in [0-9.]+ of [0-9.]+ MiB", st)):
    reflib.fail(f"--compress-weights did not take on this CPU's GEMV path: {st}")
p0 = prompts(99, [40])[0]
plain, g0 = reflib.run_engine(d, p0, 48)
coded, g1 = reflib.run_engine(d, p0, 48, extra=CW)
cdiff = float(np.abs(reflib.log_softmax64(plain) - reflib.log_softmax64(coded)).max())
if g0 != g1 or not cdiff <= 1e-5:
    reflib.fail(f"--compress-weights: tokens {'differ' if g0 != g1 else 'agree'}, logprobs {cdiff:.3g} from the plain weights")
print(f"ok  --compress-weights ({'coded GEMV' if avx else 'no AVX: flag ignored'}): 48 greedy tokens as without it, "
      f"logprobs within {cdiff:.2e} of the BF16 GEMV's")
# --compress-weights-only: the BF16 bytes released once coded, every path reads the code (a
# 64-token prompt: the packed GEMM on decoded rows); tied, the embedding rows decoded too
CO = ("--compress-weights-only",)
check("llama bf16 hidden 160 --compress-weights-only", ref, d, BF16, lengths=(3, 64), gen=48, extra=CO)
dt, reft = make_model("llama", "bfloat16", tied=True, heads=4, kv_heads=2, hidden=160, inter=352, seed=13)
check("llama bf16 tied hidden 160 --compress-weights-only", reft, dt, BF16, lengths=(5, 40), gen=24, extra=CO)
only, g2 = reflib.run_engine(d, p0, 48, extra=CO)
odiff = float(np.abs(reflib.log_softmax64(plain) - reflib.log_softmax64(only)).max())
if g0 != g2 or not odiff <= 1e-5:
    reflib.fail(f"--compress-weights-only: tokens {'differ' if g0 != g2 else 'agree'}, logprobs {odiff:.3g} from the plain weights")
st = subprocess.run([reflib.CARASERVE, "generate", "--model", dt, "--prompt-ids", "5,6,7", "--max-tokens", "2", "--stats",
                     *CO], capture_output=True, text=True, check=True).stderr
if avx and not (("+wc12only" in st and "the BF16 released" in st) or st.count("amx")):
    reflib.fail(f"--compress-weights-only did not take on this CPU: {st}")
print(f"ok  --compress-weights-only: 48 greedy tokens as without it, logprobs within {odiff:.2e} of the BF16 weights'")

# ---- files written by caraserve-mkmodel load identically in transformers ----
for arch, dtype, extra in [("llama", "bf16", ["--tied"]), ("qwen2", "f32", []), ("qwen3", "f32", ["--kv-heads", "2"]),
                           ("mistral", "bf16", ["--kv-heads", "1"])]:
    md = reflib.tmpdir(f"cs_mk_{arch}_")
    subprocess.run([reflib.MKMODEL, "model", "--out", md, "--arch", arch, "--hidden", "64", "--layers", "2",
                    "--heads", "4", "--intermediate", "96", "--vocab", str(VOCAB), "--dtype", dtype, "--seed", "3",
                    "--init-std", "0.08", *extra], check=True, capture_output=True)
    cls = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mistral": "MistralForCausalLM"}[arch])
    mref = cls.from_pretrained(md, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tol = BF16 if dtype == "bf16" else F32
    check(f"mkmodel {arch} {dtype}", mref, md, tol, lengths=(11, 100))
    ad = reflib.tmpdir("cs_mk_lora_")
    subprocess.run([reflib.MKMODEL, "adapter", "--model", md, "--out", ad, "--rank", "8", "--alpha", "16",
                    "--targets", "q,v,down", "--seed", "5", "--std", "0.1"] + (["--rslora"] if arch == "qwen3" else []),
                   check=True, capture_output=True)
    base = cls.from_pretrained(md, torch_dtype=torch.float32, attn_implementation="eager")
    aref = PeftModel.from_pretrained(base, ad, torch_dtype=torch.float32).eval().float()
    check(f"mkmodel {arch} {dtype} + mkmodel adapter", aref, md, tol, lora=ad, lengths=(25,))

# ---- the demo model (real pretrained SmolLM2-135M weights), when quickstart prepared it ----
demo = os.environ.get("CS_DEMO_MODEL")
if demo and os.path.isfile(os.path.join(demo, "config.json")):
    from tokenizers import Tokenizer
    hf_tok = Tokenizer.from_file(os.path.join(demo, "tokenizer.json"))
    # Real weights through 30 layers: transformers' own float32 forward is ~7e-5 from the
    # float64 truth, so the demo is held against float64 (tol 1e-4), and must be at least
    # as close to it as transformers' float32 is.
    d64 = transformers.AutoModelForCausalLM.from_pretrained(demo, torch_dtype=torch.float64,
                                                            attn_implementation="eager").eval()
    d32 = transformers.AutoModelForCausalLM.from_pretrained(demo, torch_dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    text = "The capital of France is Paris. The capital of Germany is"
    ids = hf_tok.encode(text).ids
    p = subprocess.run([reflib.CARASERVE, "generate", "--model", demo, "--prompt", text, "--max-tokens", "0",
                        "--print-ids"], capture_output=True, text=True, check=True)
    got = [int(t) for t in p.stdout.split("prompt_ids:")[1].split("\n")[0].strip().split(",")]
    if got != ids:
        reflib.fail(f"demo tokenizer: caraserve ids {got} != tokenizers {ids}")
    worst["demo model"] = reflib.compare("demo model (real weights) vs float64", d64, demo, ids, 24, F32)
    long_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog; caf\u00e9 \u4e2d\u6587 {i * 7}." for i in range(40))
    ids = hf_tok.encode(long_text).ids[:300]
    worst["demo model 300 tokens"] = reflib.compare("demo model 300 tokens vs float64", d64, demo, ids, 8, F32)
    rows, _ = reflib.run_engine(demo, ids, 0)
    l64, l32 = reflib.hf_logits(d64, ids), reflib.hf_logits(d32, ids)
    ls = reflib.log_softmax64
    e_ours, e_torch = float(np.abs(ls(rows) - ls(l64)).max()), float(np.abs(ls(l32) - ls(l64)).max())
    if e_ours > e_torch * 1.25:
        reflib.fail(f"demo: engine is {e_ours:.3g} from float64, transformers float32 only {e_torch:.3g}")
    print(f"ok  demo vs float64 truth: engine {e_ours:.2e}, transformers float32 {e_torch:.2e}")
else:
    print("note: CS_DEMO_MODEL not set, the real-weights demo model is not compared")

print("worst |dlogprob| per case:")
for k, v in worst.items():
    print(f"  {v:.2e}  {k}")
print("PASS")
