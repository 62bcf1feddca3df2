"""serve_client.py: a small load client for bench/serve.sh. C concurrent workers stream N
completions (token-id prompts, GEN tokens each, greedy, ignore_eos) from an OpenAI-style
/v1/completions and report throughput, TTFT and inter-token latency as one JSON object.
(caraserve-bench is the full load tester.)

    python3 bench/serve_client.py URL --concurrency C --requests N --gen G --prompt-len P [--models a,b]
"""
import argparse
import http.client
import json
import queue
import random
import threading
import time
import urllib.parse


def one(url, body):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times, finish = [], None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("choices"):
            ch = ev["choices"][0]
            if ch.get("text") is not None and (ch.get("text") or not ch.get("finish_reason")):
                times.append(time.perf_counter())
            finish = ch.get("finish_reason") or finish
    c.close()
    return t0, times, finish


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--models", default="")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    models = [m for m in a.models.split(",") if m]
    q = queue.Queue()
    for i in range(a.requests):
        body = {"prompt": [rnd.randrange(3, a.vocab) for _ in range(a.prompt_len)], "max_tokens": a.gen,
                "temperature": 0, "stream": True, "ignore_eos": True}
        if models:
            body["model"] = models[i % len(models)]
        q.put(body)
    res, errs = [], []

    def worker():
        while True:
            try:
                body = q.get_nowait()
            except queue.Empty:
                return
            try:
                res.append(one(a.url, body))
            except Exception as e:  # noqa: BLE001
                errs.append(str(e))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errs:
        raise SystemExit(f"{len(errs)} requests failed: {errs[:3]}")
    tokens = sum(len(t) for _, t, _ in res)
    ttft = sorted(t[0] - s for s, t, _ in res if t)
    itl = sorted(b - a_ for _, t, _ in res for a_, b in zip(t, t[1:]))

    def pct(v, p):
        return v[min(len(v) - 1, int(p * len(v)))] if v else None

    print(json.dumps({"concurrency": a.concurrency, "requests": a.requests, "gen": a.gen, "prompt_len": a.prompt_len,
                      "models": models, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                      "finish_length": sum(f == "length" for _, _, f in res),
                      "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
                      "itl_mean_s": sum(itl) / len(itl) if itl else None, "itl_p50_s": pct(itl, 0.5),
                      "itl_p99_s": pct(itl, 0.99)}))


if __name__ == "__main__":
    main()
