"""grpo_full.py: GRPO that trains every weight of the model, with caraserve as its rollout engine.

The same toy task and loss as grpo_loop.py (grpo_common.py), but the policy is the whole model:
each step rolls out on the server's current base weights, takes one clipped policy-gradient
step on all parameters, saves the model (safetensors) under a directory the server may read
(its --lora-root), and calls POST /v1/weights (caraserve's update, as SGLang's
/update_weights_from_disk does it: pass --sglang to call that route instead). The saved
directories alternate between two, so the disk holds two checkpoints at most; the server has
let the older go by then (keep_versions 1, nothing in flight between steps).

    python3 rollout_api/examples/grpo_full.py --server http://127.0.0.1:8000 --model DIR --save-root ROOT

Prints one line per step: reward, the base version that produced the rollout, rollout tokens/s,
the largest |server logprob - trainer logprob| over the sampled tokens, and the update's time.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
from caraserve_rollout import Client  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_common import add_loop_args, make_prompts, most_common_token, policy_step, rollout  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    add_loop_args(ap, lr=1e-5)
    ap.add_argument("--save-root", required=True, help="a directory under the server's --lora-root")
    ap.add_argument("--sglang", action="store_true", help="update through SGLang's /update_weights_from_disk")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    client = Client(a.server, api_key=a.api_key)
    prompts = make_prompts(model.config.vocab_size, a.groups, a.seed)
    tokenizer_files = [f for f in os.listdir(a.model) if f.startswith(("tokenizer", "special_tokens", "generation"))]

    def save_and_update(step):
        d = os.path.join(a.save_root, f"policy-{step % 2}")
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        for f in tokenizer_files:
            shutil.copy(os.path.join(a.model, f), d)
        t0 = time.perf_counter()
        if a.sglang:
            r = client._call("POST", "/update_weights_from_disk", {"model_path": d, "weight_version": str(step + 1),
                                                                    "flush_cache": True})
            if not r.get("success"):
                raise SystemExit(f"update_weights_from_disk: {r}")
        else:
            r = client.update_weights(d, weight_version=step + 1)
        return r, (time.perf_counter() - t0) * 1000

    target = None
    records = []
    for step in range(a.steps):
        out, tok_s = rollout(client, prompts, step, a.n, a.max_tokens)
        versions = {s["base_version"] for grp in out["groups"] for s in grp["samples"]}
        if target is None:
            target = most_common_token(out)
        reward, mismatch, loss = policy_step(model, opt, prompts, out, target, a.clip)
        upd, upd_ms = save_and_update(step)
        rec = {"step": step, "target_token": target, "rollout_base_version": sorted(versions), "reward": reward,
               "rollout_tokens_per_s": tok_s, "max_abs_logprob_diff": mismatch, "loss": loss,
               "new_base_version": upd.get("version"), "update_load": upd.get("load"), "update_ms": upd_ms,
               "update_pause_ms": upd.get("pause_ms")}
        records.append(rec)
        print(f"step {step:3d}  version {','.join(map(str, sorted(versions)))}  reward {reward:.3f}  "
              f"rollout {tok_s:.0f} tok/s  max|server-trainer logprob| {mismatch:.2e}  "
              f"-> base v{upd.get('version')} ({upd.get('load')}, {upd_ms:.0f} ms)", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "steps": records}, f, indent=1)


if __name__ == "__main__":
    main()
