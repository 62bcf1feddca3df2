"""hfmodels.py: random-weight checkpoints written by transformers' and peft's own
save_pretrained for the reference tests, and the float32 reference models that load them."""
import json
import os
import subprocess

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

import reflib

VOCAB = 512
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def perturb(model, seed, std=0.08):
    """transformers' init gives near-uniform outputs and unit norms; spread everything so a
    wrong norm, bias or rotation shows up in the logprobs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name else 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_model(kind, dtype="float32", tied=False, heads=4, kv_heads=4, hidden=64, head_dim=None, layers=2,
               inter=96, rope_scaling=None, sliding_window=None, seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if head_dim:
        common["head_dim"] = head_dim
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        if rope_scaling:
            cfg.rope_scaling = rope_scaling
            cfg.rope_parameters = dict(rope_scaling, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(sliding_window=sliding_window, rope_theta=1e6, **common)
        cls = transformers.MistralForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1e6, use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(rope_theta=1e6, use_sliding_window=False, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    perturb(model, seed)
    if tied:
        model.tie_weights()
    d = reflib.tmpdir(f"cs_ref_{kind}_")
    save = model.to(torch.bfloat16) if dtype == "bfloat16" else model
    save.save_pretrained(d, safe_serialization=True)
    # the reference: exactly the saved weights, computed in float32
    ref = cls.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return d, ref


def make_adapter(model_dir, ref_cls_model, r, alpha, targets, rslora=False, rank_pattern=None, alpha_pattern=None,
                 seed=1, dtype="float32"):
    base = type(ref_cls_model).from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                     rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, task_type="CAUSAL_LM")
    pm = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    d = reflib.tmpdir("cs_ref_lora_")
    if dtype == "bfloat16":
        pm = pm.to(torch.bfloat16)
    pm.save_pretrained(d, safe_serialization=True)
    base2 = type(ref_cls_model).from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    ref = PeftModel.from_pretrained(base2, d, torch_dtype=torch.float32).eval()
    ref = ref.float()
    return d, ref


def make_adapters(model_dir, ref_cls_model, ranks, seed, dtypes=None):
    """[(NAME, DIR)]: adapter a<k> of rank RANKS[k] and alpha 2 x rank on all seven projections,
    its weights seeded SEED + k, saved in DTYPES[k] (float32 without DTYPES)"""
    loras = []
    for k, r in enumerate(ranks):
        d, _ = make_adapter(model_dir, ref_cls_model, r=r, alpha=2 * r, targets=ALL_PROJ, seed=seed + k,
                            dtype=dtypes[k] if dtypes else "float32")
        loras.append((f"a{k}", d))
    return loras


def mixed_workload(rng, adapters, max_tokens=10):
    """18 `caraserve batch` requests mixing the adapters and the base model in one batch:
    prompts of 1-70 tokens, every third sharing a 40-token prefix (the prefix cache), greedy and
    seeded sampling, top-5 logprobs, and n=3 samples of one prompt (the fork's KV copy)."""
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    reqs = []
    for i in range(18):
        if i % 3 == 0:
            prompt = shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
        else:
            prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 70))]
        r = {"id": i, "prompt_ids": prompt, "max_tokens": max_tokens, "logprobs": 5, "ignore_eos": True}
        k = i % (len(adapters) + 1)
        if k < len(adapters):
            r["adapter"] = adapters[k]
        if i % 2:
            r.update(temperature=1.0, seed=100 + i)
        else:
            r["temperature"] = 0
        if i == 7:
            r.update(n=3, temperature=0.8, seed=5)
        reqs.append(r)
    return reqs


def run_batch(model_dir, requests, loras, args=(), env=None, what=""):
    """`caraserve batch` over REQUESTS (written as JSON lines) with --lora NAME=DIR for each of
    LORAS, the flags the batch tests share (2 threads, --stats, 48-token chunks, a 16M KV
    cache) and ARGS; the environment is os.environ without CS_TEST_DEVICE, then ENV. Returns
    its output lines (text) and its last --stats object; a failed run fails the test, naming
    WHAT."""
    path = os.path.join(reflib.tmpdir("cs_batch_"), "requests.jsonl")
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    cmd = [reflib.CARASERVE, "batch", "--model", model_dir, "--requests", path, "--threads", "2", "--stats",
           "--max-num-batched-tokens", "48", "--kv-cache-bytes", "16M", *args]
    for name, d in loras:
        cmd += ["--lora", f"{name}={d}"]
    e = dict(os.environ)
    e.pop("CS_TEST_DEVICE", None)
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=600)
    if p.returncode != 0:
        reflib.fail(f"{' '.join(cmd)} ({what})\nexit {p.returncode}\n{p.stderr[-3000:]}")
    stats = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    return p.stdout.splitlines(), (stats[-1] if stats else {})


def paired_lines(what, a, b):
    """the output lines (parsed) of two run_batch runs of one workload, side by side: the test
    fails, naming WHAT, unless they are as many and their ids in the same order"""
    if len(a) != len(b):
        reflib.fail(f"{what}: {len(a)} and {len(b)} output lines")
    for x, y in zip(a, b):
        if x.get("id") != y.get("id"):
            reflib.fail(f"{what}: lines out of order: {x.get('id')} vs {y.get('id')}")
    return list(zip(a, b))
