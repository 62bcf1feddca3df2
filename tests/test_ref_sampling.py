"""test_ref_sampling.py: the C sampler against a torch transcription of vLLM V1's sampler.

The reference follows vLLM's code paths literally (vllm/v1/sample/sampler.py,
ops/penalties.py and model_executor/layers/utils.py apply_penalties, MinPLogitsProcessor,
ops/topk_topp_sampler.py apply_top_k_top_p), in float32 torch as vLLM runs it. For random
logits over a grid of parameters, tests/sampling_harness must give: the same mask (which
tokens are -inf) unless a top-p / min-p cut is within float rounding of the threshold, the
same processed logprobs within 2e-5 (relative beyond 1), the sampled token inside the kept set and equal to the
inverse CDF in id order of the reference's probabilities at the harness's uniform, and the
sampled token's logprob, rank and top-N in the requested mode (raw or processed)."""
import json
import math
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(2)
HARNESS = os.path.join(reflib.BUILDDIR, "tests", "sampling_harness")
EPS = 1e-5   # vLLM _SAMPLING_EPS
MAX_TEMP = 1e-2


def vllm_processed(logits, prm, prompt, output, banned):
    """Returns (processed logits as vLLM's sampler sees them before sampling, borderline)."""
    x = logits.clone().float().unsqueeze(0)
    V = x.shape[1]
    if banned:
        x[0, banned] = -float("inf")  # MinTokensLogitsProcessor
    # apply_penalties: bin counts / masks, repetition (custom op's torch version), then
    # frequency and presence as OpenAI defines them
    prompt_mask = torch.zeros(1, V, dtype=torch.bool)
    if prompt:
        prompt_mask[0, prompt] = True
    counts = torch.zeros(1, V, dtype=torch.float32)
    for t in output:
        counts[0, t] += 1
    output_mask = counts > 0
    rep = torch.tensor([prm["repetition_penalty"]], dtype=torch.float32).unsqueeze(1).repeat(1, V)
    pen = torch.where(prompt_mask | output_mask, rep, 1.0)
    scaling = torch.where(x > 0, 1.0 / pen, pen)
    x *= scaling
    x -= torch.tensor([prm["frequency_penalty"]], dtype=torch.float32).unsqueeze(1) * counts
    x -= torch.tensor([prm["presence_penalty"]], dtype=torch.float32).unsqueeze(1) * output_mask
    T = prm["temperature"]
    if T < EPS:
        return x[0], False
    T = max(T, MAX_TEMP)
    x = x.div_(torch.tensor([T], dtype=torch.float32).unsqueeze(1))
    borderline = False
    if prm["min_p"] > 0:
        probs = torch.softmax(x, dim=-1)
        pmax = probs.amax(dim=-1, keepdim=True)
        thr = pmax * prm["min_p"]
        borderline |= bool(((probs - thr).abs() <= 1e-6 * thr).any())
        x[probs < thr] = -float("inf")
    k, p = prm["top_k"], prm["top_p"]
    k = None if k in (0, -1) or k >= V else torch.tensor([k])
    p = None if p >= 1 else torch.tensor([p], dtype=torch.float32)
    if k is not None or p is not None:
        srt, idx = x.sort(dim=-1, descending=False)
        if k is not None:
            kth = srt.gather(1, (srt.size(1) - k).unsqueeze(1))
            srt.masked_fill_(srt < kth, -float("inf"))
        if p is not None:
            ps = srt.softmax(dim=-1)
            cs = torch.cumsum(ps, dim=-1)
            borderline |= bool(((cs - (1 - p)).abs() < 1e-5).any())
            mask = cs <= 1 - p.unsqueeze(1)
            mask[:, -1] = False
            # a tie across the cut: which of the tied tokens survives is torch.sort's choice
            cut_out = srt[mask & torch.isfinite(srt)]
            if cut_out.numel() and cut_out.max() == srt[~mask].min():
                borderline = True
            srt.masked_fill_(mask, -float("inf"))
        x = srt.scatter(dim=-1, index=idx, src=srt)
    return x[0], borderline


def main():
    if not os.path.exists(HARNESS):
        reflib.fail(f"{HARNESS} missing (make check builds it)")
    rnd = random.Random(1)
    g = torch.Generator().manual_seed(1)
    grid = dict(temperature=[0.0, 0.005, 0.5, 1.0, 1.8], top_k=[0, -1, 1, 5, 40, 999],
                top_p=[1.0, 0.95, 0.7, 0.3], min_p=[0.0, 0.05, 0.2], repetition_penalty=[1.0, 1.3, 0.7],
                presence_penalty=[0.0, 0.6, -0.5], frequency_penalty=[0.0, 0.4, -0.3],
                logprobs_mode=["raw", "processed"])
    cases = []
    for i in range(400):
        V = rnd.choice([7, 50, 1000, 1000, 32000])
        prm = {k: rnd.choice(v) for k, v in grid.items()}
        prm["logprobs"] = rnd.choice([0, 1, 5, 20])
        prm["seed"] = rnd.randrange(1 << 40)
        scale = rnd.choice([0.5, 2.0, 6.0])
        logits = torch.randn(V, generator=g) * scale
        if i % 5 == 0:
            logits[rnd.randrange(V)] = logits.max()  # a tie at the top
        prompt = [rnd.randrange(V) for _ in range(rnd.randrange(0, 30))]
        output = [rnd.randrange(min(V, 60)) for _ in range(rnd.randrange(0, 40))]
        banned = rnd.sample(range(V), 2) if (i % 3 == 0 and V > 10) else []
        cases.append((logits, prm, prompt, output, banned))
    lines = "".join(json.dumps({"logits": [float(v) for v in c[0].tolist()], "params": c[1], "prompt": c[2],
                                "output": c[3], "banned": c[4]}) + "\n" for c in cases)
    p = subprocess.run([HARNESS], input=lines, capture_output=True, text=True)
    if p.returncode != 0:
        reflib.fail(f"harness exit {p.returncode}: {p.stderr}")
    results = [json.loads(line) for line in p.stdout.splitlines()]
    if len(results) != len(cases):
        reflib.fail(f"{len(results)} results for {len(cases)} cases")

    border = picks = 0
    for n, ((logits, prm, prompt, output, banned), res) in enumerate(zip(cases, results)):
        where = f"case {n} V={len(logits)} {prm}"
        if "error" in res:
            reflib.fail(f"{where}: {res['error']}")
        ref, borderline = vllm_processed(logits, prm, prompt, output, banned)
        ref_lp = torch.log_softmax(ref.double(), dim=-1)
        got = torch.tensor([-math.inf if v is None else v for v in res["processed_logprobs"]], dtype=torch.float64)
        kept_ref, kept_got = torch.isfinite(ref_lp), torch.isfinite(got)
        if not torch.equal(kept_ref, kept_got):
            if borderline:
                border += 1
                continue
            diff = (kept_ref != kept_got).nonzero().flatten().tolist()[:10]
            reflib.fail(f"{where}: masks differ at {diff} (ref kept {int(kept_ref.sum())}, got {int(kept_got.sum())})")
        # float32 output: an ulp is 1.2e-4 at logprob -2000 (temperature 0.01)
        err = ((ref_lp[kept_ref] - got[kept_ref]).abs() / (1 + ref_lp[kept_ref].abs())).max().item()
        if err > 2e-5:
            reflib.fail(f"{where}: processed logprobs differ by {err}")
        tok = res["token"]
        if not kept_ref[tok]:
            reflib.fail(f"{where}: sampled {tok}, which vLLM masks")
        if prm["temperature"] < EPS:
            if tok != int(torch.argmax(ref)):
                reflib.fail(f"{where}: greedy {tok}, want {int(torch.argmax(ref))}")
        else:
            probs = torch.softmax(ref.double(), dim=-1)
            cdf = torch.cumsum(probs, dim=-1)
            u = res["u"]
            want = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
            near = (cdf - u).abs().min().item() < 1e-6
            if not near:
                picks += 1
                if tok != want:
                    reflib.fail(f"{where}: u={u} picked {tok}, inverse CDF gives {want}")
        lp = torch.log_softmax(logits.double(), dim=-1) if prm["logprobs_mode"] == "raw" else ref_lp
        if abs(res["logprob"] - lp[tok].item()) > 2e-5 * (1 + abs(lp[tok].item())):
            reflib.fail(f"{where}: token logprob {res['logprob']} want {lp[tok].item()}")
        rank = int((lp >= lp[tok] - 1e-6).sum())
        rank_lo = int((lp > lp[tok] + 1e-6).sum()) + 1
        if not rank_lo <= res["rank"] <= rank:
            reflib.fail(f"{where}: rank {res['rank']} want {rank_lo}..{rank}")
        top = res["top"]
        nt = min(prm["logprobs"], len(logits))
        if len(top) != nt:
            reflib.fail(f"{where}: {len(top)} top entries, want {nt}")
        vals, _ = torch.topk(lp, nt)
        for j, (tid, tlp) in enumerate(top):
            tlp = -math.inf if tlp is None else tlp
            tol = 2e-5 * (1 + abs(tlp))
            if not (abs(tlp - vals[j].item()) <= tol or (math.isinf(tlp) and math.isinf(vals[j].item()))):
                reflib.fail(f"{where}: top[{j}] = ({tid}, {tlp}), want logprob {vals[j].item()}")
            if not (abs(lp[tid].item() - tlp) <= tol or (math.isinf(tlp) and math.isinf(lp[tid].item()))):
                reflib.fail(f"{where}: top[{j}] id {tid} has logprob {lp[tid].item()}, reported {tlp}")
            prev = lp[top[j - 1][0]].item() if j else math.inf
            if j and (prev < lp[tid].item() or (prev == lp[tid].item() and top[j - 1][0] > tid)):
                reflib.fail(f"{where}: top not sorted by (logprob desc, id asc): {top}")
    if border > len(cases) // 20:
        reflib.fail(f"{border} borderline cases of {len(cases)}: too many to be rounding")
    if picks < len(cases) // 3:
        reflib.fail(f"only {picks} inverse-CDF picks checked")
    print(f"PASS: {len(cases)} cases, {picks} inverse-CDF picks, {border} borderline top-p/min-p cuts skipped")


if __name__ == "__main__":
    main()
