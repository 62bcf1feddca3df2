"""bench/tenants.py: the helper of bench/tenants.sh (many tenants: thousands of adapters on disk).

    tenants.py adapters MODEL DIR N [--seed S]     write N PEFT adapters DIR/t00000 ... (ranks 8/16/32/64
                                                   in turn, q_proj and v_proj, BF16, alpha 2r) as
                                                   `caraserve-mkmodel adapter --targets q,v --dtype bf16` writes them
    tenants.py compare A B                         the two adapter directories' config and tensor names,
                                                   dtypes, shapes and offsets side by side (exit 1 on a difference)
    tenants.py popularity CSV N OUT [--hot H] [--hot-share S]
                                                   scale CSV's popularity to N adapters (below); write OUT
                                                   (adapter,probability for caraserve-bench) and print the hot set
    tenants.py schedule DUMP POP HOT B_OUT A_OUT [TIERS_OUT K]
                                                   the dumped schedule with each adapter's rank (B), and
                                                   the same with every non-hot request moved to a hot adapter
                                                   of its rank (A); TIERS_OUT: the K least popular adapters
                                                   that B never asks for
    tenants.py wait-health PORT T0 [TIMEOUT]       poll /health every 10 ms; print seconds since T0 (epoch)
    tenants.py warm PORT NAMES_FILE IN             one unmeasured 1-token request per adapter, in turn
    tenants.py tiers PORT NAMES_FILE IN            first-request latency by tier (below), as JSON
    tenants.py probe PORT PID OUT_JSON [--models] [--stats NAME ...]
                                                   VmRSS, GET /metrics (bytes and lora counters),
                                                   optionally the paged /v1/models and adapter stats
    tenants.py report ...                          the result JSON and the plot (see tenants.sh)

Popularity scaling: the CSV (CaraServe's Azure Functions popularity over M = 512 adapters) is
read as a curve over the rank fraction: sort its shares from the most popular down, C(k/M) =
the share of the top k, linear in between. Adapter i of N (i = 0 the most popular) gets
C((i+1)/N) - C(i/N): each of the M shares spread evenly over N/M adapters in a row. The three
files CaraServe published (128, 256, 512 adapters) follow one such curve (the top 10% of
adapters get 70%, 72%, 73% of requests; the top 20% 88%, 88%, 88%), which is why it is scaled
over the fraction and not by keeping the top adapters' absolute shares.

Tiers (tiers): for each adapter of NAMES_FILE (never requested before), in turn, a streamed
request of IN prompt tokens and max_tokens 1: "disk" (the first request: registered-on-disk,
or unknown and resolved from --lora-resolve, and loaded); after all of them, again each: "host"
(it was loaded, then the others were; in host memory); and at once again: "resident" (just
used). TTFT (to the first chunk with choices) and the whole request's latency, in ms.
"""
import json
import math
import os
import random
import shutil
import struct
import sys
import time
import urllib.error
import urllib.request

RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "v_proj")
PEFT_VERSION = "0.21.2"  # tools/mkmodel.c's PEFT_VERSION


def name_of(i):
    return f"t{i:05d}"


def rank_of(i):
    return RANKS[i % len(RANKS)]


# ---- adapters ----

def model_dims(model):
    c = json.load(open(os.path.join(model, "config.json")))
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kvh = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or hidden // heads
    return c["num_hidden_layers"], {"q_proj": (hidden, heads * hd), "v_proj": (hidden, kvh * hd),
                                    "k_proj": (hidden, kvh * hd)}


def adapter_config(model, rank, alpha):
    """adapter_config.json exactly as caraserve-mkmodel adapter writes it (keys sorted, indent 2)"""
    cfg = {k: None for k in (
        "alora_invocation_tokens", "arrow_config", "auto_mapping", "corda_config", "eva_config", "exclude_modules",
        "kasa_config", "lora_ga_config", "layer_replication", "layers_pattern", "layers_to_transform",
        "megatron_config", "modules_to_save", "monteclora_config", "revision", "target_parameters",
        "trainable_token_indices", "use_bdlora", "velora_config")}
    cfg.update({"alpha_pattern": {}, "rank_pattern": {}, "loftq_config": {},
                "base_model_name_or_path": os.path.realpath(model), "bias": "none", "ensure_weight_tying": False,
                "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "lora_alpha": alpha,
                "lora_bias": False, "lora_dropout": 0.0, "megatron_core": "megatron.core", "peft_type": "LORA",
                "peft_version": PEFT_VERSION, "qalora_group_size": 16, "r": rank, "target_modules": list(TARGETS),
                "task_type": "CAUSAL_LM", "use_dora": False, "use_qalora": False, "use_rslora": False})
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def bf16_pool(n, seed, std=0.02):
    """n BF16 values (as uint16) of N(0, std), rounded to nearest even from F32"""
    import numpy as np
    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(std)
    u = x.view(np.uint32)
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (u >> np.uint32(16)).astype(np.uint16)


def write_adapter(path, model, layers, dims, rank, pool, rng):
    """one adapter: its tensors are slices of POOL at random offsets (distinct weights, written fast)"""
    names = []
    for l in range(layers):
        for t in TARGETS:
            din, dout = dims[t]
            names.append((f"base_model.model.model.layers.{l}.self_attn.{t}.lora_A.weight", [rank, din]))
            names.append((f"base_model.model.model.layers.{l}.self_attn.{t}.lora_B.weight", [dout, rank]))
    names.sort(key=lambda x: x[0].encode())  # mkmodel sorts by strcmp
    hdr, off, chunks = {"__metadata__": {"format": "pt"}}, 0, []
    for n, shape in names:
        cnt = shape[0] * shape[1]
        hdr[n] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + 2 * cnt]}
        s = rng.randrange(0, len(pool) - cnt)
        chunks.append(pool[s:s + cnt].tobytes())
        off += 2 * cnt
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(adapter_config(model, rank, 2 * rank))
    tmp = os.path.join(path, "adapter_model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    os.replace(tmp, os.path.join(path, "adapter_model.safetensors"))
    return 8 + len(h) + off


def cmd_adapters(args):
    model, out, n = args[0], args[1], int(args[2])
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    layers, dims = model_dims(model)
    pool = bf16_pool(1 << 22, seed)
    total, t0 = 0, time.time()
    os.makedirs(out, exist_ok=True)
    for i in range(n):
        p = os.path.join(out, name_of(i))
        if os.path.isfile(os.path.join(p, "adapter_model.safetensors")) and \
                os.path.isfile(os.path.join(p, "adapter_config.json")):
            total += os.path.getsize(os.path.join(p, "adapter_model.safetensors"))
            continue
        total += write_adapter(p, model, layers, dims, rank_of(i), pool, random.Random(seed * 1000003 + i))
        if (i + 1) % 1000 == 0:
            print(f"tenants.py: {i + 1}/{n} adapters written ({time.time() - t0:.0f} s)", file=sys.stderr)
    print(json.dumps({"adapters": n, "bytes": total, "seconds": round(time.time() - t0, 2)}))


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
    return n, list(json.loads(raw).items()), os.path.getsize(path)


def cmd_compare(args):
    a, b = args
    bad = 0
    ca, cb = (open(os.path.join(d, "adapter_config.json")).read() for d in (a, b))
    if ca != cb:
        import difflib
        sys.stdout.writelines(difflib.unified_diff(ca.splitlines(True), cb.splitlines(True), a, b))
        bad = 1
    ha, hb = (st_header(os.path.join(d, "adapter_model.safetensors")) for d in (a, b))
    if ha != hb:
        print(f"safetensors headers differ: {a}: {ha[0]} bytes, {len(ha[1])} keys, file {ha[2]}; "
              f"{b}: {hb[0]} bytes, {len(hb[1])} keys, file {hb[2]}")
        for x, y in zip(ha[1], hb[1]):
            if x != y:
                print(" ", x, "\n ", y)
        bad = 1
    print("same config and tensor layout" if not bad else "DIFFERENT")
    return bad


# ---- popularity ----

def scaled_popularity(csv_path, n):
    rows = [l.strip().split(",") for l in open(csv_path) if l.strip()]
    try:
        float(rows[0][1])
    except ValueError:
        rows = rows[1:]
    p = sorted((float(r[1]) for r in rows), reverse=True)
    s, m = sum(p), len(p)
    cum = [0.0]
    for x in p:
        cum.append(cum[-1] + x / s)

    def C(x):  # the top fraction x of adapters' share, linear between the file's points
        k = min(int(x * m), m - 1)
        return cum[k] + (x * m - k) * (cum[k + 1] - cum[k])

    w = [C((i + 1) / n) - C(i / n) for i in range(n)]
    t = sum(w)
    return [x / t for x in w]


def hot_count(w, hot, share):
    if hot > 0:
        return min(hot, len(w))
    c = 0.0
    for k, x in enumerate(w):
        c += x
        if c >= share - 1e-12:
            return k + 1
    return len(w)


def cmd_popularity(args):
    csv_path, n, out = args[0], int(args[1]), args[2]
    hot = int(args[args.index("--hot") + 1]) if "--hot" in args else 0
    share = float(args[args.index("--hot-share") + 1]) if "--hot-share" in args else 0.5
    w = scaled_popularity(csv_path, n)
    with open(out, "w") as f:
        f.write("adapter,probability\n")
        for i, x in enumerate(w):
            f.write(f"{name_of(i)},{x:.12g}\n")
    h = hot_count(w, hot, share)
    print(json.dumps({"hot": h, "hot_share": sum(w[:h]), "top_share": w[0], "bottom_share": w[-1],
                      "top1pct_share": sum(w[:max(1, n // 100)]), "top10pct_share": sum(w[:max(1, n // 10)])}))


# ---- schedule ----

def cmd_schedule(args):
    dump, pop, hot_n, b_out, a_out = args[0], args[1], int(args[2]), args[3], args[4]
    n = sum(1 for l in open(pop)) - 1
    hot = [name_of(i) for i in range(hot_n)]
    hot_by_rank = {r: [h for i, h in enumerate(hot) if rank_of(i) == r] for r in RANKS}
    index = {name_of(i): i for i in range(n)}
    fb, fa = open(b_out, "w"), open(a_out, "w")
    moved = 0
    for line in open(dump):
        if line.startswith("#") or line.startswith("id,"):
            fb.write(line)
            fa.write(line)
            continue
        c = line.rstrip("\n").split(",")
        i = index[c[2]]
        c[3] = str(rank_of(i))
        fb.write(",".join(c) + "\n")
        if i >= hot_n:
            pool = hot_by_rank[rank_of(i)] or hot
            c[2] = pool[(i // len(RANKS)) % len(pool)]
            moved += 1
        fa.write(",".join(c) + "\n")
    fb.close()
    fa.close()
    res = {"moved_to_hot_in_A": moved}
    if len(args) > 6:  # TIERS_OUT K: the K least popular adapters the schedule never asks for
        used = set(l.split(",")[2] for l in open(b_out) if l[0].isdigit())
        free = [name_of(i) for i in range(n - 1, hot_n - 1, -1) if name_of(i) not in used][:int(args[6])]
        open(args[5], "w").write("".join(x + "\n" for x in free))
        res["tier_adapters"] = len(free)
    res["distinct_adapters_in_B"] = len(set(l.split(",")[2] for l in open(b_out) if l[0].isdigit()))
    print(json.dumps(res))


# ---- HTTP ----

def url(port, path):
    return f"http://127.0.0.1:{port}{path}"


def http_get(port, path, timeout=30):
    with urllib.request.urlopen(url(port, path), timeout=timeout) as r:
        return r.status, r.read()


def cmd_wait_health(args):
    port, t0 = args[0], float(args[1])
    timeout = float(args[2]) if len(args) > 2 else 600
    while time.time() - t0 < timeout:
        try:
            st, _ = http_get(port, "/health", timeout=2)
            if st == 200:
                print(f"{time.time() - t0:.3f}")
                return 0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.01)
    print(f"tenants.py: nothing answers /health on port {port}", file=sys.stderr)
    return 1


def complete(port, model, n_in, seed):
    """one streamed 1-token completion: (ok, ttft_ms, latency_ms, error)"""
    rng = random.Random(seed)
    body = json.dumps({"model": model, "prompt": [rng.randrange(100, 32000) for _ in range(n_in)],
                       "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url(port, "/v1/completions"), data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                d = line[5:].strip()
                if d == b"[DONE]":
                    break
                o = json.loads(d)
                if "error" in o:
                    return False, None, None, json.dumps(o["error"])[:200]
                if ttft is None and o.get("choices"):
                    ttft = (time.perf_counter() - t0) * 1e3
    except urllib.error.HTTPError as e:
        return False, None, None, f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, None, None, str(e)[:200]
    lat = (time.perf_counter() - t0) * 1e3
    return ttft is not None, ttft, lat, None if ttft is not None else "no chunk with choices"


def cmd_warm(args):
    port, names, n_in = args[0], [l.strip() for l in open(args[1]) if l.strip()], int(args[2])
    bad = 0
    for k, m in enumerate(names):
        ok, _, _, err = complete(port, m, n_in, 7 + k)
        if not ok:
            bad += 1
            if bad <= 3:
                print(f"tenants.py: warm-up request to {m} failed: {err}", file=sys.stderr)
    print(json.dumps({"warmed": len(names) - bad, "failed": bad}))
    return 1 if bad == len(names) and names else 0


def summary(xs):
    import numpy as np
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    a = np.array(xs)
    return {"n": len(xs), "mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "min_ms": float(a.min()), "max_ms": float(a.max())}


def cmd_tiers(args):
    port, names, n_in = args[0], [l.strip() for l in open(args[1]) if l.strip()], int(args[2])
    rows = {"disk": [], "host": [], "resident": []}
    errs = []
    for k, m in enumerate(names):
        rows["disk"].append((m,) + complete(port, m, n_in, 1000 + k))
    for k, m in enumerate(names):
        rows["host"].append((m,) + complete(port, m, n_in, 2000 + k))
        rows["resident"].append((m,) + complete(port, m, n_in, 3000 + k))
    out = {}
    for tier, rs in rows.items():
        errs += [f"{tier} {m}: {e}" for m, ok, _, _, e in rs if not ok]
        out[tier] = {"ttft": summary([t for _, ok, t, _, _ in rs if ok]),
                     "latency": summary([l for _, ok, _, l, _ in rs if ok]),
                     "failed": sum(1 for r in rs if not r[1]),
                     "ttft_ms": [t for _, ok, t, _, _ in rs]}
    out["adapters"] = names
    out["prompt_tokens"] = n_in
    out["errors"] = errs[:10]
    print(json.dumps(out))


def metric_totals(text):
    """per metric name (prefix caraserve_ dropped) the sum of its samples, for the lora/adapter
    counters and gauges that carry no adapter label; and the number of series with adapter="""
    import re
    tot, adapter_series, labels = {}, 0, set()
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)', line)
        if not m:
            continue
        name, lab, val = m.group(1), m.group(2) or "", m.group(3)
        a = re.search(r'adapter="((?:[^"\\]|\\.)*)"', lab)
        if a:
            adapter_series += 1
            labels.add(a.group(1))
            continue
        base = name.removeprefix("caraserve_")
        if ("lora" in base or "adapter" in base) and not base.endswith(("_bucket", "_created")):
            try:
                tot[base] = tot.get(base, 0.0) + float(val)
            except ValueError:
                pass
    return tot, adapter_series, len(labels)


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def cmd_probe(args):
    port, pid, out = args[0], args[1], args[2]
    res = {"rss_kib": rss_kib(pid)}
    try:
        t0 = time.perf_counter()
        st, body = http_get(port, "/metrics")
        res["scrape_ms"] = (time.perf_counter() - t0) * 1e3
        res["scrape_bytes"] = len(body)
        text = body.decode(errors="replace")
        res["scrape_lines"] = sum(1 for l in text.splitlines() if l and l[0] != "#")
        res["lora_metrics"], res["adapter_series"], res["adapter_labels"] = metric_totals(text)
    except (urllib.error.URLError, OSError) as e:
        res["scrape_error"] = str(e)
    if "--models" in args:  # GET /v1/models whole, then paged (limit 100, after the last id)
        try:
            t0 = time.perf_counter()
            st, body = http_get(port, "/v1/models")
            res["models_whole"] = {"ids": len(json.loads(body).get("data", [])), "bytes": len(body),
                                   "ms": (time.perf_counter() - t0) * 1e3}
        except (urllib.error.URLError, OSError, ValueError) as e:
            res["models_whole"] = {"error": str(e)[:200]}
        ids, pages, after, t0, err = 0, 0, None, time.perf_counter(), None
        while pages < 100000:
            q = "/v1/models?limit=100" + (f"&after={urllib.parse.quote(after)}" if after else "")
            try:
                st, body = http_get(port, q)
            except (urllib.error.URLError, OSError) as e:
                err = str(e)
                break
            o = json.loads(body)
            data = o.get("data", [])
            pages += 1
            ids += len(data)
            if not data or not o.get("has_more", False):
                res["models_paging"] = "has_more" in o
                break
            after = o.get("last_id") or data[-1]["id"]
        res["models"] = {"ids": ids, "pages": pages, "ms": (time.perf_counter() - t0) * 1e3, "error": err}
    if "--stats" in args:
        res["adapter_stats"] = {}
        for name in args[args.index("--stats") + 1:]:
            try:
                st, body = http_get(port, f"/v1/adapters/{name}/stats")
                res["adapter_stats"][name] = json.loads(body)
            except (urllib.error.URLError, OSError, ValueError) as e:
                res["adapter_stats"][name] = {"error": str(e)[:200]}
    json.dump(res, open(out, "w"), indent=1)


# ---- report ----

def load_requests(path):
    import csv
    return {int(r["id"]): r for r in csv.DictReader(open(path))}


def pct(xs, q):
    import numpy as np
    return float(np.percentile(np.array(xs), q)) if xs else None


def stats(rows):
    ok = [r for r in rows if r["ok"] == "1"]
    ttft = [float(r["ttft_ms"]) for r in ok]
    tpot = [float(r["tpot_ms"]) for r in ok if r["tpot_ms"] not in ("", None) and int(r["output_tokens"] or 0) > 1]
    return {"requests": len(rows), "failed": len(rows) - len(ok),
            "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99), "mean_ttft_ms": sum(ttft) / len(ttft) if ttft else None,
            "p50_tpot_ms": pct(tpot, 50), "p99_tpot_ms": pct(tpot, 99), "mean_tpot_ms": sum(tpot) / len(tpot) if tpot else None}


def ratio(b, a):
    return b / a if a and b is not None else None


def cmd_report(args):
    """report WORK OUT_JSON: everything tenants.sh left in WORK (params.json, sched-B.csv, req-{A,B}-ROUND.csv,
    res-{A,B}-ROUND.json, probe_*.json, tiers_*.json, startup.json) into OUT_JSON and its PNG"""
    work, out = args[0], args[1]
    P = json.load(open(os.path.join(work, "params.json")))
    j = lambda n: json.load(open(os.path.join(work, n))) if os.path.exists(os.path.join(work, n)) else None
    hot = set(name_of(i) for i in range(P["hot"]))
    rounds = P.get("rounds", 1)
    sb = {}  # B's schedule: each request's real adapter (A sent the others' to hot adapters: told apart by id)
    for line in open(os.path.join(work, "sched-B.csv")):
        if line[0].isdigit():
            c = line.split(",")
            sb[int(c[0])] = c[2]
    hot_ids = sorted(i for i, m in sb.items() if m in hot)
    cold_ids = sorted(i for i, m in sb.items() if m not in hot)
    # every round's rows, keyed (round, id); the pooled figures are over all rounds
    ra, rb, rc, per_round = {}, {}, {}, []
    K4 = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
    for r in range(1, rounds + 1):
        a, b = (load_requests(os.path.join(work, f"req-{t}-{r}.csv")) for t in ("A", "B"))
        cpath = os.path.join(work, f"req-C-{r}.csv")
        c = load_requests(cpath) if os.path.exists(cpath) else {}
        ra.update({(r, i): x for i, x in a.items()})
        rb.update({(r, i): x for i, x in b.items()})
        rc.update({(r, i): x for i, x in c.items()})
        ah, bh = stats([a[i] for i in hot_ids if i in a]), stats([b[i] for i in hot_ids if i in b])
        ch = stats([c[i] for i in hot_ids if i in c])
        per_round.append({"round": r, "A_hot_only": ah, "B_all_resolvable": bh, "C_all_registered": ch,
                          "B_over_A": {k: ratio(bh[k], ah[k]) for k in K4},
                          "C_over_A": {k: ratio(ch[k], ah[k]) for k in K4}})
    hot_keys = [(r, i) for r in range(1, rounds + 1) for i in hot_ids]
    cold_keys = [(r, i) for r in range(1, rounds + 1) for i in cold_ids]
    A_hot, B_hot = stats([ra[k] for k in hot_keys if k in ra]), stats([rb[k] for k in hot_keys if k in rb])
    C_hot = stats([rc[k] for k in hot_keys if k in rc])
    res = {"benchmark": "tenants", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res.update({k: P[k] for k in ("model", "adapters", "ranks", "targets", "adapter_dtype", "adapter_bytes_on_disk",
                                  "adapters_generated_s", "popularity_file", "popularity_scaling", "hot", "hot_share",
                                  "hot_definition", "host_cache_adapters", "device_slots", "kv_cache_bytes", "requests",
                                  "request_rate", "input_tokens", "output_tokens", "seed", "threads", "rounds",
                                  "run_A", "run_B", "run_C")})
    res["hot_set"] = {
        "requests_per_round": len(hot_ids), "cold_requests_per_round_in_B": len(cold_ids),
        "pooled_over_rounds": rounds,
        "A_hot_only": A_hot, "B_all_resolvable": B_hot,
        "B_over_A": {k: ratio(B_hot[k], A_hot[k]) for k in K4},
        "C_all_registered": C_hot, "C_over_A": {k: ratio(C_hot[k], A_hot[k]) for k in K4},
        "rounds": per_round,
    }
    res["all_requests"] = {"A": stats(list(ra.values())), "B": stats(list(rb.values())),
                           "B_cold_only": stats([rb[k] for k in cold_keys if k in rb])}
    for tag in ("A", "B"):
        rs = [j(f"res-{tag}-{r}.json") for r in range(1, rounds + 1)]
        res["all_requests"][tag]["request_throughput"] = [x.get("request_throughput") if x else None for x in rs]
        res["all_requests"][tag]["output_throughput"] = [x.get("output_throughput") if x else None for x in rs]
        res["all_requests"][tag]["duration_s"] = [x.get("duration") if x else None for x in rs]
    # first-request latency by tier
    res["first_request"] = {}
    for tag, label in (("B", "resolved (--lora-resolve)"), ("dir", "registered (--lora-modules-dir)")):
        t = j(f"tiers_{tag}.json")
        if t:
            res["first_request"][tag if tag == "dir" else "resolve"] = {
                "how": label, "prompt_tokens": t["prompt_tokens"], "adapters": t["adapters"], "errors": t["errors"],
                **{tier: {"ttft": t[tier]["ttft"], "latency": t[tier]["latency"], "failed": t[tier]["failed"]}
                   for tier in ("disk", "host", "resident")}}
    # start-up, RSS, scrape
    p0, p1, pA, pB = j("probe_base.json") or {}, j("probe_dir.json") or {}, j("probe_A.json") or {}, j("probe_B.json") or {}
    st = j("startup.json") or {}
    res["startup"] = {"base_only_s": st.get("base"), "modules_dir_s": st.get("dir"),
                      "modules_dir_extra_s": (st["dir"] - st["base"]) if "dir" in st and "base" in st else None,
                      "note": "spawn to the first 200 of GET /health (polled every 10 ms); adapter files in the page "
                              "cache (just generated or read)"}
    rss = None
    if p0.get("rss_kib") and p1.get("rss_kib"):
        rss = (p1["rss_kib"] - p0["rss_kib"]) * 1024 / P["adapters"]
    res["rss"] = {"base_only_kib": p0.get("rss_kib"), "modules_dir_kib": p1.get("rss_kib"),
                  "per_registered_adapter_bytes": rss,
                  "note": "VmRSS 1 s after /health answers: with --lora-modules-dir (every adapter registered, none "
                          "requested) less the base model alone, over the adapters; two processes differ by ~100 KiB, "
                          "so it means something for thousands of adapters"}
    if "models" in p1:
        res["models_list"] = {"whole": p1.get("models_whole"), "paged_by_100": p1["models"]}
    if j("paired.json"):
        res["paired"] = j("paired.json")
    for k, p in (("modules_dir_idle", p1), ("A_after_run", pA), ("B_after_run", pB)):
        res.setdefault("scrape", {})[k] = {x: p.get(x) for x in ("scrape_bytes", "scrape_lines", "scrape_ms",
                                                                 "adapter_series", "adapter_labels")}
        res.setdefault("server_lora_metrics", {})[k] = p.get("lora_metrics")
    if pB.get("adapter_stats"):
        res["adapter_stats_sample"] = pB["adapter_stats"]
    scr = [p.get("scrape_bytes") for p in (p1, pB) if p.get("scrape_bytes") is not None]
    g, gc = res["hot_set"]["B_over_A"], res["hot_set"]["C_over_A"]
    within = lambda x: x is not None and x <= 1.10
    res["goals"] = {
        # the same requests, NAD adapters registered and resolvable: what their presence costs
        "registered_hot_p99_ttft_within_10pct": within(gc["p99_ttft_ms"]),
        "registered_hot_p99_tpot_within_10pct": within(gc["p99_tpot_ms"]),
        # the tail's own requests too (loads, evictions, more adapters per batch): B
        "resolvable_with_tail_hot_p99_ttft_within_10pct": within(g["p99_ttft_ms"]),
        "resolvable_with_tail_hot_p99_tpot_within_10pct": within(g["p99_tpot_ms"]),
        "rss_per_registered_adapter_under_8kib": rss is not None and rss < 8192,
        "scrape_under_200kb": bool(scr) and max(scr) < 200_000,
    }
    res["goals"]["all"] = all(res["goals"].values())
    if B_hot["failed"] or A_hot["failed"] or res["all_requests"]["B"]["failed"]:
        res["warning"] = "some requests failed: see all_requests"
    png = out[:-5] + ".png" if out.endswith(".json") else out + ".png"
    try:
        plot(png, P, ra, rb, hot_keys, res)
        res["plot"] = os.path.basename(png)
    except ImportError:
        res["plot"] = None
        res["plot_note"] = "matplotlib is not importable from this Python: JSON only"
    json.dump(res, open(out, "w"), indent=2)


def plot(png, P, ra, rb, hot_ids, res):
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(2, 3, figsize=(16, 9))
    fig.suptitle(f"tenants: {P['adapters']} adapters (ranks {'/'.join(map(str, P['ranks']))}), hot set {P['hot']} "
                 f"({100 * P['hot_share']:.0f}% of requests), host cache {P['host_cache_adapters']}, "
                 f"{P['requests']} requests at {P['request_rate']}/s", fontsize=11)
    for k, (metric, title) in enumerate((("ttft_ms", "hot set TTFT"), ("tpot_ms", "hot set TPOT"))):
        a = ax[0][k]
        for rows, lab in ((ra, "A: hot set only"), (rb, f"B: all {P['adapters']} resolvable")):
            xs = np.sort([float(rows[i][metric]) for i in hot_ids if i in rows and rows[i]["ok"] == "1"
                          and rows[i][metric] not in ("",)])
            if len(xs):
                a.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=lab)
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        a.set_xlabel(metric.replace("_ms", " (ms)"))
        a.set_ylabel("CDF")
        a.set_title(title)
        a.grid(alpha=.3)
        a.legend(fontsize=8)
    a = ax[0][2]
    cold = sorted(set(rb) - set(hot_ids))
    xs = np.sort([float(rb[i]["ttft_ms"]) for i in cold if rb[i]["ok"] == "1"])
    if len(xs):
        a.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label="B: the other adapters' requests", color="C3")
    xs = np.sort([float(rb[i]["ttft_ms"]) for i in hot_ids if i in rb and rb[i]["ok"] == "1"])
    if len(xs):
        a.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label="B: hot set", color="C1")
    a.set_xscale("log")
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_xlabel("TTFT (ms)")
    a.set_title("B: hot set vs the tail")
    a.grid(alpha=.3)
    a.legend(fontsize=8)
    # first request by tier
    a = ax[1][0]
    labels, vals = [], []
    for src, fr in res["first_request"].items():
        for tier in ("disk", "host", "resident"):
            t = fr.get(tier, {}).get("ttft")
            if t:
                labels.append(f"{src}\n{tier}")
                vals.append(t["p50_ms"])
    a.bar(range(len(vals)), vals, color=(["C3", "C0", "C2"] * 2)[:len(vals)])
    a.set_xticks(range(len(vals)), labels, fontsize=8)
    a.set_ylabel("median TTFT (ms)")
    a.set_title("first request by tier")
    # the popularity curve
    a = ax[1][1]
    w = scaled_popularity(P["popularity_file"], P["adapters"])
    a.loglog(np.arange(1, len(w) + 1), w, label=f"scaled to {P['adapters']}")
    a.axvline(P["hot"], color="k", ls=":", label=f"hot set ({P['hot']})")
    a.axvline(P["host_cache_adapters"] or len(w), color="C3", ls="--", label="host cache")
    a.set_xlabel("adapter (most popular first)")
    a.set_ylabel("share of requests")
    a.set_title("popularity")
    a.grid(alpha=.3)
    a.legend(fontsize=8)
    # text: the goals
    a = ax[1][2]
    a.axis("off")
    h = res["hot_set"]
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)
    lines = [f"hot set (pooled over {P.get('rounds', 1)} rounds)", "                A        C     C/A        B     B/A"]
    for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms"):
        lines.append(f"{k:<12} {fmt(h['A_hot_only'][k]):>8} {fmt(h['C_all_registered'][k]):>8} "
                     f"{fmt(h['C_over_A'][k], '{:.3f}'):>7} {fmt(h['B_all_resolvable'][k]):>8} "
                     f"{fmt(h['B_over_A'][k], '{:.3f}'):>7}")
    r = res["rss"]["per_registered_adapter_bytes"]
    lines += ["", f"RSS / registered adapter: {fmt(r, '{:.0f}')} B",
              f"start-up: base {fmt(res['startup']['base_only_s'], '{:.2f}')} s, "
              f"--lora-modules-dir {fmt(res['startup']['modules_dir_s'], '{:.2f}')} s"]
    for k, v in res["scrape"].items():
        lines.append(f"scrape {k}: {v.get('scrape_bytes')} B")
    lines.append("")
    lines += [f"{'PASS' if v else 'FAIL'}  {k}" for k, v in res["goals"].items() if k != "all"]
    a.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def cmd_paired(args):
    """paired BUILD MODEL ADAPTERS HOT ROUNDS N OUT_JSON: what registering every adapter of ADAPTERS
    costs one request: servers with the HOT most popular adapters alone (--lora-modules) and with all
    of them (--lora-modules-dir) in turn, ROUNDS times, N sequential requests each (128 prompt tokens,
    16 out, greedy) over the hot adapters after a warm-up; latency percentiles per server"""
    import socket
    import statistics
    import subprocess
    build, model, ads, hot_n, rounds, n, out = args[0], args[1], args[2], int(args[3]), int(args[4]), int(args[5]), args[6]
    hot = [name_of(i) for i in range(hot_n)]

    def start(extra):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        p = subprocess.Popen([os.path.join(build, "caraserve"), "serve", "--model", model, "--served-model-name", "m",
                              "--port", str(port), "--threads", "2", "--kv-cache-bytes", "256M",
                              "--max-cpu-loras", "512"] + extra, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while time.time() - t0 < 600:
            try:
                urllib.request.urlopen(url(port, "/health"), timeout=1)
                return p, port
            except Exception:
                time.sleep(0.02)
        p.kill()
        sys.exit("paired: a server did not start")

    def run(port, k):
        ts = []
        for i in range(k):
            body = json.dumps({"model": hot[i % len(hot)], "prompt": list(range(5, 133)), "max_tokens": 16,
                               "ignore_eos": True, "temperature": 0}).encode()
            t = time.perf_counter()
            urllib.request.urlopen(urllib.request.Request(url(port, "/v1/completions"), body,
                                                          {"Content-Type": "application/json"}), timeout=60).read()
            ts.append((time.perf_counter() - t) * 1000)
        return ts
    res = {"hot_only": [], "all_registered": []}
    for _ in range(rounds):
        for tag, extra in (("hot_only", ["--lora-modules"] + [f"{h}={ads}/{h}" for h in hot]),
                           ("all_registered", ["--lora-modules-dir", ads])):
            p, port = start(extra)
            run(port, len(hot))
            res[tag] += run(port, n)
            p.terminate()
            p.wait()
    summary_ = {t: {"requests": len(v), "p50_ms": pct(v, 50), "p90_ms": pct(v, 90), "p99_ms": pct(v, 99),
                    "mean_ms": statistics.mean(v)} for t, v in res.items()}
    json.dump({"benchmark": "tenants_paired", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "adapters": len([d for d in os.listdir(ads) if not d.startswith(".")]), "hot": hot_n,
               "rounds": rounds, "requests_per_round": n,
               "how": "servers with the hot adapters alone and with every adapter registered, in turn; sequential "
                      "1-at-a-time completions (128 prompt tokens, 16 out) over the hot adapters after a warm-up",
               **summary_,
               "all_over_hot_only": {k: summary_["all_registered"][k] / summary_["hot_only"][k]
                                     for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")}}, open(out, "w"), indent=2)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    f = {"adapters": cmd_adapters, "compare": cmd_compare, "popularity": cmd_popularity, "schedule": cmd_schedule,
         "wait-health": cmd_wait_health, "warm": cmd_warm, "tiers": cmd_tiers, "probe": cmd_probe,
         "report": cmd_report, "paired": cmd_paired}.get(cmd)
    if not f:
        sys.exit(__doc__)
    sys.exit(f(args) or 0)


if __name__ == "__main__":
    import urllib.parse  # noqa: F401 (probe's quoting)
    main()
