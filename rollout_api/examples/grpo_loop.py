"""grpo_loop.py: a minimal GRPO trainer that uses caraserve as its rollout engine.

Each step: roll out G prompts x n samples with the current LoRA version (caraserve's
/v1/rollout), score them with a verifiable reward (the toy task: the share of generated tokens
equal to one target token, the one the first rollout produced most often), compute group-relative advantages, recompute the sampled tokens' logprobs
with transformers + peft on the same base model and adapter (the server's logprobs are the
behaviour policy's: their difference is the training/inference mismatch), take one clipped
policy-gradient step on the LoRA parameters, push the new weights as the next version
(PUT /v1/adapters/NAME/versions/V, raw safetensors), and go again.

    python3 rollout_api/examples/grpo_loop.py --server http://127.0.0.1:8000 --model DIR [--steps 20]

Prints one line per step: reward, the version that produced the rollout, rollout tokens/s,
and the largest |server logprob - trainer logprob| over the sampled tokens.
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import transformers
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
from caraserve_rollout import Client  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_common import add_loop_args, make_prompts, most_common_token, policy_step, rollout  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    add_loop_args(ap, lr=3e-3)
    ap.add_argument("--adapter", default="policy")
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    base = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32,
                                                             attn_implementation="eager")
    cfg = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                     lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # a small random B so the first versions already differ from the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=a.lr)
    client = Client(a.server, api_key=a.api_key)
    prompts = make_prompts(model.config.vocab_size, a.groups, a.seed)
    out_dir = tempfile.mkdtemp(prefix="grpo_")

    def push(version):
        model.save_pretrained(out_dir, safe_serialization=True)
        with open(os.path.join(out_dir, "adapter_model.safetensors"), "rb") as f:
            return client.push_adapter(a.adapter, version, f.read(), lora_alpha=cfg.lora_alpha,
                                       target_modules=sorted(cfg.target_modules))

    version = 1
    push(version)
    target = None
    records = []
    for step in range(a.steps):
        out, tok_s = rollout(client, prompts, step, a.n, a.max_tokens, adapter=a.adapter)
        versions = {s["adapter_version"] for grp in out["groups"] for s in grp["samples"]}
        if target is None:
            target = most_common_token(out)
        reward, mismatch, loss = policy_step(model, opt, prompts, out, target, a.clip)
        version += 1
        pushed = push(version)
        rec = {"step": step, "target_token": target, "rollout_version": sorted(versions), "reward": reward,
               "rollout_tokens_per_s": tok_s, "max_abs_logprob_diff": mismatch, "loss": loss,
               "pushed_version": pushed["version"], "push_ms": pushed["load_ms"]}
        records.append(rec)
        print(f"step {step:3d}  version {','.join(map(str, sorted(versions)))}  reward {rec['reward']:.3f}  "
              f"rollout {rec['rollout_tokens_per_s']:.0f} tok/s  max|server-trainer logprob| {mismatch:.2e}  "
              f"-> pushed v{pushed['version']}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "steps": records}, f, indent=1)


if __name__ == "__main__":
    main()
