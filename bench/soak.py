"""soak.py: hold `caraserve serve` under a long mixed load with faults (bench/soak.sh runs it).

All at once, for MINUTES:
  - caraserve-bench: streamed completions at a Poisson rate over the base model and two adapters;
  - non-streaming completions (text prompts, n=2, logprobs) and chat (streamed and not);
  - rollouts: groups of n=2 with logprobs; every third is streamed, aborted while its samples
    run (/v1/rollout/abort) and one partial sample resumed with continue_from;
  - clients that hang up mid-stream (a socket closed after the first event);
  - adapter churn every 3 s: a load, one request, an unload; a new version of "policy" pushed
    (raw safetensors, keep_versions=2) and rolled out on;
  - every 10 s, reference prompts on the base model and two fixed adapters (greedy, the server
    started with --batch-invariant so batching cannot change them) checked against the tokens
    they gave at the start, before any load;
  - every second: the server's RSS, open file descriptors, threads, KV-cache use, requests
    running and waiting.
Writes bench/results/soak-<time>.json (minutes, http_5xx, wrong_answers, rss_growth after
warm-up, fd and thread ranges, counts per kind of traffic, the samples) and an SVG plot.
The goal: zero 5xx, zero wrong answers, RSS growth under 5% after warm-up, fds and
threads flat."""
import argparse
import http.client
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "rollout_api", "clients", "python"))
from caraserve_rollout import Client, RolloutError  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--minutes", type=float, required=True)
ap.add_argument("--build", required=True)
ap.add_argument("--model", required=True)
ap.add_argument("--adapters", required=True, help="directory with a8, a16, churn0, churn1, policy0..2")
ap.add_argument("--chat-template", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--results", required=True)
ap.add_argument("--rate", type=float, default=2.0, help="caraserve-bench requests/s")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--warmup", type=float, default=0.2, help="share of the run before RSS is measured")
args = ap.parse_args()

END = None
stop = threading.Event()
lock = threading.Lock()
counts = {}      # kind -> {"ok": n, "4xx": n, "5xx": n, "other": n}
errors = []      # first few 5xx / unexpected answers
wrong = []       # reference mismatches


def count(kind, status, detail=""):
    with lock:
        c = counts.setdefault(kind, {"ok": 0, "4xx": 0, "5xx": 0, "other": 0})
        key = "ok" if status == 200 else "4xx" if 400 <= status < 500 else "5xx" if status >= 500 else "other"
        c[key] += 1
        if key in ("5xx", "other") and len(errors) < 50:
            errors.append({"kind": kind, "status": status, "detail": str(detail)[:300], "t": round(time.time() - T0, 1)})


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


COMMIT = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
DIRTY = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                       text=True).stdout.strip()
PORT = free_port()
A = args.adapters
os.makedirs(os.path.join(args.work, "uploads"), exist_ok=True)
server_log = open(os.path.join(args.work, "server.log"), "w")
srv = subprocess.Popen([os.path.join(args.build, "caraserve"), "serve", "--model", args.model, "--host", "127.0.0.1",
                        "--port", str(PORT), "--threads", str(args.threads), "--batch-invariant",
                        "--kv-cache-bytes", "48M", "--max-num-seqs", "16", "--chat-template", args.chat_template,
                        "--lora-modules", f"a8={A}/a8", f"a16={A}/a16", "--lora-root", A,
                        "--adapter-upload-dir", os.path.join(args.work, "uploads"), "--shutdown-timeout", "30"],
                       stdout=server_log, stderr=subprocess.STDOUT)
PID = srv.pid


def req(method, path, body=None, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                  headers={"Content-Type": "application/json"} if body is not None else {})
        r = c.getresponse()
        txt = r.read()
    finally:
        c.close()
    try:
        return r.status, json.loads(txt)
    except ValueError:
        return r.status, txt.decode("utf-8", "replace")


for _ in range(600):
    try:
        if req("GET", "/health", timeout=5)[0] == 200:
            break
    except OSError:
        pass
    time.sleep(0.5)
else:
    sys.exit("soak: the server did not become ready; see " + os.path.join(args.work, "server.log"))
cl = Client(f"http://127.0.0.1:{PORT}")
BASE = req("GET", "/v1/models")[1]["data"][0]["id"]

# ---- the reference answers, on an idle server ----
REF_PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 29871, 13, 3492, 526, 263], [1, 306, 763, 278, 2768, 310, 8437]]
REF_MODELS = [None, "a8", "a16"]


def reference_run():
    out = {}
    groups = [{"group_id": f"{i}", "input_ids": p, "n": 1, "seed": 0} for i, p in enumerate(REF_PROMPTS)]
    for m in REF_MODELS:
        r = cl.rollout(groups, adapter=m, sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                    "logprobs": False})
        for g in r["groups"]:
            out[(m, g["group_id"])] = g["samples"][0]["output_ids"]
    return out


EXPECTED = reference_run()
T0 = time.time()
END = T0 + args.minutes * 60


def loop(kind, body, pause):
    def run():
        rng = random.Random(hash(kind) & 0xffff)
        while not stop.is_set():
            try:
                body(rng)
            except (OSError, http.client.HTTPException) as e:
                count(kind, -1, repr(e))
            stop.wait(pause * (0.5 + rng.random()))
    t = threading.Thread(target=run, name=kind, daemon=True)
    t.start()
    return t


def words(rng, n):
    return " ".join(rng.choice(["the", "quick", "brown", "fox", "café", "日本", "data", "model", "x=1;", "\n"])
                    for _ in range(n))


def completions(rng):
    st, b = req("POST", "/v1/completions", {"model": rng.choice([BASE, "a8", "a16"]), "prompt": words(rng, 20),
                                            "max_tokens": 12, "n": 2, "logprobs": 2, "temperature": 0.8,
                                            "seed": rng.randrange(1000)})
    count("completions", st, b)


def chat(rng):
    stream = rng.random() < 0.5
    body = {"model": rng.choice([BASE, "a8"]), "messages": [{"role": "user", "content": words(rng, 12)}],
            "max_tokens": 10, "stream": stream}
    if not stream:
        st, b = req("POST", "/v1/chat/completions", body)
        count("chat", st, b)
        return
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    txt = r.read().decode("utf-8", "replace")
    c.close()
    ok = r.status == 200 and txt.rstrip().endswith("data: [DONE]")
    count("chat_stream", r.status if ok or r.status != 200 else -2, txt[-200:])


def rollout(rng):
    sampling = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    aborting = rng.random() >= 0.67
    if aborting:  # long enough that the abort lands while the other groups run
        sampling["max_tokens"] = 160
    groups = [{"group_id": f"g{k}", "input_ids": [1] + [rng.randrange(100, 32000) for _ in range(12)], "n": 2,
               "seed": rng.randrange(10**6)} for k in range(3)]
    if not aborting:
        try:
            cl.rollout(groups, adapter=rng.choice([None, "a8", "policy"]), sampling=sampling)
            count("rollout", 200)
        except RolloutError as e:
            count("rollout", e.status, e.body)
        return
    # streamed, aborted while under way, then one partial sample resumed
    bid = f"soak-{rng.randrange(10**9)}"
    body = {"groups": groups, "sampling": sampling, "batch_id": bid, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
    c.request("POST", "/v1/rollout", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        count("rollout_abort", r.status, r.read()[:200])
        c.close()
        return
    stop.wait(0.2 + 0.4 * rng.random())  # the samples are under way
    lines = []
    try:
        cl.abort(batch_id=bid)
    except RolloutError as e:
        count("rollout_abort", e.status, e.body)
    for line in r:
        if line.strip():
            lines.append(json.loads(line))
    c.close()
    if "summary" not in lines[-1] or len(lines) != 4:
        count("rollout_abort", -3, lines[-1])
        return
    count("rollout_abort", 200)
    for g in lines[:-1]:
        s = g["samples"][0]
        if s["finish_reason"] == "abort" and 0 < len(s["output_ids"]) < sampling["max_tokens"]:
            src = next(x for x in groups if x["group_id"] == g["group_id"])
            try:
                out = cl.rollout([{"input_ids": src["input_ids"], "n": 1, "seed": 1,
                                   "continue_from": {"output_ids": s["output_ids"]}}], sampling=sampling)
                rs = out["groups"][0]["samples"][0]
                ok = rs["resumed_len"] == len(s["output_ids"]) and len(s["output_ids"]) + len(rs["output_ids"]) == sampling["max_tokens"]
                count("rollout_resume", 200 if ok else -4, rs)
            except RolloutError as e:
                count("rollout_resume", e.status, e.body)
            break


def hangup(rng):
    sk = socket.create_connection(("127.0.0.1", PORT), timeout=60)
    body = json.dumps({"model": rng.choice([BASE, "a16"]), "prompt": words(rng, 10), "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:
        chunk = sk.recv(4096)
        if not chunk:
            break
        got += chunk
    sk.close()
    status = 200 if got.startswith(b"HTTP/1.1 200") else int(got[9:12]) if got[9:12].isdigit() else -5
    count("hangup", status, got[:200])


policy_version = [0]


def churn(rng):
    name = f"churn{rng.randrange(2)}"
    st, b = req("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"{A}/{name}"})
    count("adapter_load", st, b)
    if st == 200:
        st, b = req("POST", "/v1/completions", {"model": name, "prompt": words(rng, 8), "max_tokens": 6})
        count("adapter_request", st, b)
        st, b = req("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        count("adapter_unload", st, b)
    policy_version[0] += 1
    with open(f"{A}/policy{policy_version[0] % 3}/adapter_model.safetensors", "rb") as f:
        data = f.read()
    try:
        cl.push_adapter("policy", policy_version[0], data, lora_alpha=16, keep_versions=2)
        count("adapter_push", 200)
    except RolloutError as e:
        count("adapter_push", e.status, e.body)


def reference(rng):
    got = reference_run()
    for k, v in EXPECTED.items():
        if got[k] != v:
            with lock:
                wrong.append({"t": round(time.time() - T0, 1), "model": k[0], "prompt": int(k[1]), "want": v, "got": got[k]})
    count("reference", 200)


samples = []


def metrics():
    st, txt = req("GET", "/metrics", timeout=30)
    vals = {}
    if st == 200:
        for line in txt.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
    pick = lambda name: next((v for k, v in vals.items() if k.split("{")[0].endswith(name)), None)  # noqa: E731
    return pick("kv_cache_usage_perc"), pick("num_requests_running"), pick("num_requests_waiting")


def sampler():
    while not stop.is_set():
        t = time.time() - T0
        try:
            st = open(f"/proc/{PID}/status").read()
            rss = int(next(x for x in st.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
            anon = int(next(x for x in st.splitlines() if x.startswith("RssAnon:")).split()[1]) * 1024
            thr = int(next(x for x in st.splitlines() if x.startswith("Threads:")).split()[1])
            fds = len(os.listdir(f"/proc/{PID}/fd"))
            kv, run, wait = metrics()
            samples.append({"t": round(t, 2), "rss": rss, "rss_anon": anon, "fds": fds, "threads": thr, "kv": kv, "running": run,
                            "waiting": wait})
        except (OSError, StopIteration, http.client.HTTPException):
            pass
        stop.wait(1.0)


bench_out = os.path.join(args.work, "bench.json")
bench = subprocess.Popen([os.path.join(args.build, "caraserve-bench"), "--base-url", f"http://127.0.0.1:{PORT}",
                          "--duration", str(int(args.minutes * 60)),
                          "--request-rate", str(args.rate), "--lora-modules", "a8:8", "a16:16", "--base-fraction", "0.3",
                          "--random-input-len", "48", "--random-output-len", "24", "--random-range-ratio", "0.5",
                          "--vocab-size", "32000", "--seed", "7", "--save-result", "--save-detailed",
                          "--result-dir", args.work, "--result-filename", "bench.json"],
                         stdout=open(os.path.join(args.work, "bench.log"), "w"), stderr=subprocess.STDOUT)
threads = [threading.Thread(target=sampler, daemon=True)]
threads[0].start()
threads += [loop("completions", completions, 1.0), loop("chat", chat, 1.0), loop("rollout", rollout, 1.5),
            loop("hangup", hangup, 2.0), loop("churn", churn, 3.0), loop("reference", reference, 10.0)]
last_print = 0
while time.time() < END and srv.poll() is None:
    time.sleep(1)
    if time.time() - last_print >= 60:
        last_print = time.time()
        s = samples[-1] if samples else {}
        print(f"soak: {(time.time() - T0) / 60:.1f} min, rss {s.get('rss', 0) / 2**20:.0f} MiB, fds {s.get('fds')}, "
              f"threads {s.get('threads')}, 5xx {sum(c['5xx'] for c in counts.values())}, wrong {len(wrong)}",
              file=sys.stderr, flush=True)
stop.set()
for t in threads:
    t.join(timeout=600)
bench.wait(timeout=900)
server_died = srv.poll() is not None
srv.terminate()
try:
    srv.wait(timeout=60)
except subprocess.TimeoutExpired:
    srv.kill()

# ---- caraserve-bench's own answers ----
bench_stats = {}
try:
    bj = json.load(open(bench_out))
    errs = [e for e in bj.get("errors", []) if e]
    b5 = sum(1 for e in errs if e.startswith("HTTP 5"))
    bench_stats = {"completed": bj.get("completed"), "failed": bj.get("failed"), "http_5xx": b5,
                   "other_errors": len(errs) - b5, "first_errors": errs[:5]}
    counts["bench"] = {"ok": bj.get("completed", 0), "4xx": sum(1 for e in errs if e.startswith("HTTP 4")),
                       "5xx": b5, "other": len(errs) - b5 - sum(1 for e in errs if e.startswith("HTTP 4"))}
except (OSError, ValueError) as e:
    bench_stats = {"error": repr(e)}

# ---- the report ----
warm = args.minutes * 60 * args.warmup
after = [s for s in samples if s["t"] >= warm]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0


# growth: the median RSS of the last minute against the median of the first minute after the
# warm-up (a single sample of either would measure the second's allocation, not a trend);
# rss_growth_peak: the last minute's highest sample against the same start
rss0 = median([s["rss"] for s in after[:60]])
rss_growth = (median([s["rss"] for s in after[-60:]]) - rss0) / rss0 if rss0 else None
rss_growth_peak = (max(s["rss"] for s in after[-60:]) - rss0) / rss0 if rss0 else None
anon0 = median([s["rss_anon"] for s in after[:60]])
anon_growth = (median([s["rss_anon"] for s in after[-60:]]) - anon0) / anon0 if anon0 else None
rng_of = lambda key: [min(s[key] for s in after), max(s[key] for s in after)] if after else None  # noqa: E731
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
           platform.processor())
http_5xx = sum(c["5xx"] for c in counts.values())
report = {
    "kind": "soak", "minutes": args.minutes, "cpu": cpu, "threads": args.threads,
    "commit": COMMIT + ("+changes" if DIRTY else ""),  # at the start: what the server was built from
    "http_5xx": http_5xx, "wrong_answers": len(wrong), "server_died": server_died,
    "rss_growth": rss_growth, "rss_growth_peak": rss_growth_peak, "rss_anon_growth": anon_growth,
    "rss_after_warmup_bytes": rss0, "warmup_s": warm,
    "fds_after_warmup": rng_of("fds"), "threads_after_warmup": rng_of("threads"),
    "unexpected_answers": sum(c["other"] for c in counts.values()),
    "counts": counts, "bench": bench_stats, "errors": errors, "wrong": wrong[:20],
    "goal": {"http_5xx": 0, "wrong_answers": 0, "rss_growth_below": 0.05},
    "samples": samples,
}
report["goal_met"] = (http_5xx == 0 and not wrong and not server_died and rss_growth is not None
                      and "error" not in bench_stats and bench.returncode == 0
                      and rss_growth < 0.05 and report["unexpected_answers"] == 0)
stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
os.makedirs(args.results, exist_ok=True)
path = os.path.join(args.results, f"soak-{stamp}.json")
json.dump(report, open(path, "w"), indent=1)


# ---- the plot: RSS, fds, threads, KV use over time ----
def svg(path):
    W, H, L, R, T, B = 900, 420, 60, 20, 30, 40
    if not samples:
        return
    tmax = max(s["t"] for s in samples) or 1
    series = [("rss", "RSS (MiB)", "#1f77b4", lambda s: s["rss"] / 2**20), ("fds", "open fds", "#ff7f0e", lambda s: s["fds"]),
              ("threads", "threads", "#2ca02c", lambda s: s["threads"]),
              ("kv", "KV use (%)", "#d62728", lambda s: (s["kv"] or 0) * 100)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H * len(series)}" font-family="sans-serif" '
           f'font-size="12">']
    for i, (key, label, color, f) in enumerate(series):
        y0 = i * H
        vals = [f(s) for s in samples]
        lo, hi = min(vals), max(vals)
        if hi == lo:
            hi = lo + 1
        pts = " ".join(f"{L + (W - L - R) * s['t'] / tmax:.1f},{y0 + T + (H - T - B) * (1 - (v - lo) / (hi - lo)):.1f}"
                       for s, v in zip(samples, vals))
        out.append(f'<text x="{L}" y="{y0 + 18}">{label}: {lo:.1f} .. {hi:.1f} over {tmax / 60:.1f} min '
                   f'(warm-up ends at {warm / 60:.1f} min)</text>')
        out.append(f'<rect x="{L}" y="{y0 + T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#999"/>')
        wx = L + (W - L - R) * min(warm / tmax, 1)
        out.append(f'<line x1="{wx:.1f}" y1="{y0 + T}" x2="{wx:.1f}" y2="{y0 + H - B}" stroke="#bbb" stroke-dasharray="4"/>')
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{pts}"/>')
        out.append(f'<text x="{L - 5}" y="{y0 + T + 4}" text-anchor="end">{hi:.0f}</text>')
        out.append(f'<text x="{L - 5}" y="{y0 + H - B}" text-anchor="end">{lo:.0f}</text>')
        out.append(f'<text x="{W - R}" y="{y0 + H - B + 16}" text-anchor="end">{tmax / 60:.1f} min</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out))


svg(path[:-5] + ".svg")
summary = {k: report[k] for k in ("minutes", "http_5xx", "wrong_answers", "server_died", "rss_growth", "rss_growth_peak",
                                  "fds_after_warmup", "threads_after_warmup", "unexpected_answers", "goal_met")}
print(json.dumps(summary), file=sys.stderr)
print(json.dumps(counts), file=sys.stderr)
print(f"soak: {path}", file=sys.stderr)
sys.exit(0 if report["goal_met"] else 1)
