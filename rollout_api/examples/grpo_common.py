"""grpo_common.py: what the two GRPO examples share (grpo_loop.py trains a LoRA and pushes it
as an adapter version; grpo_full.py trains every weight and updates the base weights): the toy
task's prompts and reward, one rollout step, and one clipped policy-gradient step that also
measures the largest |server logprob - trainer logprob| over the sampled tokens."""
import time

import torch


def add_loop_args(ap, lr):
    """the arguments both loops take (the learning rate's default is the loop's own)"""
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True, help="the model directory the server started on")
    ap.add_argument("--api-key")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", help="write the per-step records here")


def make_prompts(vocab, groups, seed):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(6 + 3 * i),), generator=g).tolist() for i in range(groups)]


def rollout(client, prompts, step, n, max_tokens, adapter=None):
    """One /v1/rollout of every prompt x n at temperature 1 with processed logprobs (the
    behaviour policy's): (response, tokens per second)."""
    t0 = time.perf_counter()
    out = client.rollout([{"group_id": str(i), "input_ids": p, "n": n, "seed": 1000 * step + 10 * i}
                          for i, p in enumerate(prompts)], adapter=adapter, batch_id=f"step-{step}",
                         sampling={"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
                                   "logprobs": {"mode": "processed"}})
    return out, out["summary"]["output_tokens"] / (time.perf_counter() - t0)


def most_common_token(out):
    """the toy task's target: the token the first rollout produced most often"""
    counts = {}
    for grp in out["groups"]:
        for s in grp["samples"]:
            for t in s["output_ids"]:
                counts[t] = counts.get(t, 0) + 1
    return max(sorted(counts), key=lambda t: counts[t])


def policy_step(model, opt, prompts, out, target, clip):
    """Rewards (the share of generated tokens equal to TARGET), group-relative advantages, the
    trainer's logprobs of the sampled tokens and one clipped policy-gradient step.
    Returns (mean reward, largest |server - trainer| logprob, loss)."""
    seqs, olds, advs, rewards = [], [], [], []
    for grp in out["groups"]:
        p = prompts[int(grp["group_id"])]
        r = torch.tensor([sum(t == target for t in s["output_ids"]) / len(s["output_ids"]) for s in grp["samples"]])
        adv = (r - r.mean()) / (r.std() + 1e-6)
        rewards += r.tolist()
        for s, ad in zip(grp["samples"], adv.tolist()):
            seqs.append((p, s["output_ids"]))
            olds.append(torch.tensor(s["logprobs"], dtype=torch.float64))
            advs.append(ad)
    model.train()
    opt.zero_grad()
    mismatch, loss_total = 0.0, 0.0
    for (p, o), old, ad in zip(seqs, olds, advs):
        ids = torch.tensor([p + o])
        logits = model(ids).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(o)[:, None])[:, 0]
        mismatch = max(mismatch, (lp.detach().double() - old).abs().max().item())
        ratio = torch.exp(lp - old.float())
        loss = -torch.min(ratio * ad, torch.clamp(ratio, 1 - clip, 1 + clip) * ad).mean() / len(seqs)
        loss.backward()
        loss_total += loss.item()
    opt.step()
    model.eval()
    return sum(rewards) / len(rewards), mismatch, loss_total
