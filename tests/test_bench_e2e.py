"""test_bench_e2e.py: caraserve-bench end to end against `caraserve serve` (a small transformers-written
Llama with the real 32k tokenizer and three peft adapters of ranks 8, 16 and 64). Nothing here
asserts on timing; every check is an account that must balance:

1. /v1/completions for a few seconds (Poisson arrivals, zipf popularity, 20% base model, a
   concurrency cap, an SLO): completed + failed = requests = the dumped schedule's rows, no failure,
   per-adapter and per-rank counts and tokens add up to the totals, every request's output tokens
   equal its drawn length (ignore_eos) and the server's own generation counter agrees, the time
   series adds up, the per-request CSV has every request once, the SVG parses, vLLM's keys are there,
   the exact peak in flight stays under the cap and vLLM's per-second peak is at least it.
2. Replaying the dumped schedule (--dataset-name trace) sends the same requests; the JSON's
   request_rate says what set the arrivals (null for a replay or a ramp, the rate otherwise).
3. /v1/rollout: groups x n samples per request, tokens = groups x n x drawn length; TPOT and ITL are
   not measured (null, with a note) and a TPOT bound is reported as not applicable rather than
   passing; a TPOT-only bound and a call of more than INT_MAX tokens are refused. Against a scripted
   rollout server: the server-side statistics leave out samples without tokens (ttft_ms -1) and
   the samples of failed calls.
4. Failures are accounted for: requests to an adapter the server lacks fail (404) and count as SLO
   misses; against a closed port every request fails and the exit status is 1.
5. --help and bench/README.md document every flag the program parses."""
import csv
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from hfmodels import make_adapter  # noqa: E402
from serverlib import Server, make_tok_model  # noqa: E402

torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()
BENCH = os.path.join(reflib.BUILDDIR, "caraserve-bench")

model_dir, ref_base, _ = make_tok_model("spm-32k", seed=9)
ranks = {"a8": 8, "a16": 16, "a64": 64}
adapters = {}
for name, r in ranks.items():
    adapters[name], _ = make_adapter(model_dir, ref_base, r=r, alpha=2 * r, targets=["q_proj", "v_proj", "down_proj"],
                                     seed=40 + r)
srv = Server(["--model", model_dir, "--served-model-name", "base", "--lora-modules",
              *[f"{n}={d}" for n, d in adapters.items()], "--threads", "2", "--kv-cache-bytes", "64M"])
work = reflib.tmpdir("cs_bench_e2e_")
LORA = [f"{n}:{r}" for n, r in ranks.items()]


def bench(*args, rc=0, base=None):
    cmd = [BENCH, "--base-url", base or srv.base, "--no-progress", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != rc:
        reflib.fail(f"{' '.join(cmd)}\nexit {p.returncode} (want {rc})\n{p.stdout}\n{p.stderr}")
    return p


def load(name):
    with open(os.path.join(work, name)) as f:
        return json.load(f)


def schedule(name):
    with open(os.path.join(work, name)) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return rows


def counter(name):
    """the sum of a counter over all its label sets"""
    _, vals = srv.metrics()
    return sum(v for k, v in vals.items() if k == name or k.startswith(name + "{"))


def check_balances(r, what, n, want_failed=0):
    if r["total_requests"] != n or r["completed"] + r["failed"] != n or r["failed"] != want_failed:
        reflib.fail(f"{what}: {r['completed']} completed + {r['failed']} failed of {r['total_requests']}, want {n} "
                    f"with {want_failed} failed")
    for key in ("per_adapter", "per_rank"):
        groups = r[key]
        for field, total in (("requests", n), ("completed", r["completed"]), ("failed", r["failed"]),
                             ("total_output_tokens", r["total_output_tokens"]),
                             ("total_input_tokens", r["total_input_tokens"])):
            s = sum(g[field] for g in groups)
            if s != total:
                reflib.fail(f"{what}: {key} {field} add up to {s}, the total is {total}")
    ts = r["timeseries"]
    if sum(b["arrivals"] for b in ts) != n or sum(b["completed"] for b in ts) != r["completed"] or \
            sum(b["failed"] for b in ts) != r["failed"] or sum(b["slo_requests"] for b in ts) != n:
        reflib.fail(f"{what}: the time series does not add up: {ts}")
    if sum(b["output_tokens"] for b in ts) < r["total_output_tokens"] / 2:
        reflib.fail(f"{what}: the time series lost output tokens")


# ---- 1. completions ----
gen0, ok0 = counter("caraserve_generation_tokens_total"), counter("caraserve_request_success_total")
p = bench("--model", "base", "--lora-modules", *LORA, "--popularity", "zipf:1.0", "--base-fraction", "0.2",
          "--request-rate", "6", "--duration", "3", "--max-concurrency", "8", "--random-input-len", "24",
          "--random-output-len", "12", "--random-range-ratio", "0.5", "--seed", "5", "--goodput", "ttft:60000",
          "tpot:60000", "--metric-percentiles", "50,90,99", "--per-adapter", "--per-rank", "--save-result",
          "--save-detailed", "--result-dir", work, "--result-filename", "run.json", "--dump-schedule",
          os.path.join(work, "sched.csv"), "--requests-csv", os.path.join(work, "req.csv"), "--plot",
          os.path.join(work, "plot.svg"))
r = load("run.json")
rows = schedule("sched.csv")
n = len(rows)
if n < 5:
    reflib.fail(f"only {n} requests in 3 s at 6/s")
check_balances(r, "completions", n)
want_out = [int(x["output_len"]) for x in rows]
want_in = [int(x["input_len"]) for x in rows]
if r["output_lens"] != want_out or r["total_output_tokens"] != sum(want_out):
    reflib.fail(f"output tokens {r['output_lens']} != the drawn lengths {want_out} (ignore_eos)")
if r["input_lens"] != want_in or r["total_input_tokens"] != sum(want_in):
    reflib.fail(f"input tokens {r['input_lens']} != {want_in}")
gen1, ok1 = counter("caraserve_generation_tokens_total"), counter("caraserve_request_success_total")
if gen1 - gen0 != r["total_output_tokens"] or ok1 - ok0 != n:
    reflib.fail(f"the server generated {gen1 - gen0} tokens for {ok1 - ok0} requests; the bench counted "
                f"{r['total_output_tokens']} for {n}")
by_model = {}
for x in rows:
    by_model[x["model"] or "base"] = by_model.get(x["model"] or "base", 0) + 1
got = {g["adapter"]: g["requests"] for g in r["per_adapter"] if g["requests"]}
if got != by_model:
    reflib.fail(f"per-adapter requests {got} != the schedule's {by_model}")
for g in r["per_adapter"]:
    if g["adapter"] in ranks and g["rank"] != ranks[g["adapter"]]:
        reflib.fail(f"adapter {g['adapter']} reported with rank {g['rank']}")
if sorted(g["rank"] for g in r["per_rank"]) != sorted({0 if x["model"] == "" else ranks[x["model"]] for x in rows}):
    reflib.fail(f"per-rank groups {[g['rank'] for g in r['per_rank']]}")
att = r["slo_attainment"]
if att["requests"] != n or att["good"] > r["completed"] or abs(att["all"] - att["good"] / n) > 1e-9:
    reflib.fail(f"slo_attainment {att}")
for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
            "max_concurrent_requests", "max_concurrent_requests_exact", "mean_ttft_ms", "median_ttft_ms",
            "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "p90_tpot_ms", "mean_itl_ms", "p50_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "mean_sched_ttft_ms",
            "schema_version", "config", "slo", "ttfts", "itls", "errors", "date", "model_id", "max_concurrency"):
    if key not in r:
        reflib.fail(f"no key {key} in the result")
# the cap bounds what is in flight at one instant; vLLM's per-second count also adds requests that
# only shared a second, so it is at least that
if r["max_concurrency"] != 8 or not 1 <= r["max_concurrent_requests_exact"] <= 8 or \
        r["max_concurrent_requests"] < r["max_concurrent_requests_exact"]:
    reflib.fail(f"max_concurrency {r['max_concurrency']}, peak {r['max_concurrent_requests']} per second, "
                f"{r['max_concurrent_requests_exact']} at one instant")
if r["request_rate"] != 6 or r["arrival"] != "poisson" or r["config"]["request_rate"] != 6:
    reflib.fail(f"request_rate {r['request_rate']!r}, arrival {r['arrival']!r}")
if any(x is None for x in (r["mean_tpot_ms"], r["p99_itl_ms"])) or "tpot_itl" in r or \
        any(not isinstance(i, list) for i in r["itls"]):
    reflib.fail("completions: TPOT and ITL must be measured")
# caraserve streams one chunk per token with the finish reason on the last: out - 1 gaps (one
# more if a finish ever came in a chunk of its own)
if any(not (out - 1 <= len(itl) <= out) for itl, out in zip(r["itls"], want_out)):
    reflib.fail(f"chunk gaps per request {[len(i) for i in r['itls']]} for outputs {want_out}")
with open(os.path.join(work, "req.csv")) as f:
    req = list(csv.DictReader(f))
if sorted(int(x["id"]) for x in req) != list(range(n)) or any(x["ok"] != "1" for x in req):
    reflib.fail("the requests CSV does not list every request once, all ok")
if [int(x["output_tokens"]) for x in sorted(req, key=lambda x: int(x["id"]))] != want_out:
    reflib.fail("the requests CSV's output tokens differ from the schedule")
svg = ET.parse(os.path.join(work, "plot.svg")).getroot()
if not svg.tag.endswith("svg") or len(svg.findall(".//{http://www.w3.org/2000/svg}polyline")) < 6:
    reflib.fail("the SVG plot has no curves")
if "============ Serving Benchmark Result ============" not in p.stdout or \
        not re.search(rf"^Successful requests:\s+{n}\s*$", p.stdout, re.M) or "Per Adapter" not in p.stdout:
    reflib.fail(f"the table:\n{p.stdout}")
print(f"ok  completions: {n} requests over {len(by_model)} models, {r['total_output_tokens']} tokens as drawn "
      f"and as the server counted; breakdowns, time series, CSV and SVG add up")

# ---- 2. replay ----
bench("--model", "base", "--dataset-name", "trace", "--dataset-path", os.path.join(work, "sched.csv"),
      "--save-result", "--save-detailed", "--result-dir", work, "--result-filename", "replay.json")
r2 = load("replay.json")
check_balances(r2, "replay", n)
if r2["output_lens"] != want_out or r2["input_lens"] != want_in or \
        {g["adapter"]: g["requests"] for g in r2["per_adapter"] if g["requests"]} != by_model:
    reflib.fail("the replayed schedule differs from the dumped one")
if max(abs(a - b) for a, b in zip(r2["scheduled_times"], [float(x["arrival_s"]) for x in rows])) > 1e-6:
    reflib.fail("the replay's arrival times differ")
if "request_rate" not in r2 or r2["request_rate"] is not None or r2["arrival"] != "schedule" or \
        r2["config"]["arrival"] != "schedule":
    reflib.fail(f"replay: request_rate {r2.get('request_rate')!r}, arrival {r2.get('arrival')!r}")
bench("--model", "base", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "4", "--ramp-up-end-rps", "16",
      "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "2", "--save-result", "--result-dir",
      work, "--result-filename", "ramp.json")
r2r = load("ramp.json")
if "request_rate" not in r2r or r2r["request_rate"] is not None or r2r["arrival"] != "poisson" or \
        r2r.get("ramp_up_strategy") != "linear" or r2r.get("ramp_up_start_rps") != 4 or \
        r2r.get("ramp_up_end_rps") != 16 or r2r["completed"] != 4:
    reflib.fail(f"ramp: {({k: r2r.get(k) for k in ('request_rate', 'arrival', 'ramp_up_strategy', 'completed')})}")
print(f"ok  replay of the dumped schedule: the same {n} requests; request_rate null for a replay and a ramp")

# ---- 3. rollout ----
bench("--model", "base", "--endpoint", "/v1/rollout", "--lora-modules", *LORA, "--popularity", "round-robin",
      "--rollout-n", "3", "--rollout-groups", "2", "--num-prompts", "4", "--request-rate", "inf",
      "--random-input-len", "20", "--random-output-len", "6", "--random-range-ratio", "0.5", "--seed", "2",
      "--goodput", "ttft:600000", "tpot:0.001", "--save-result", "--save-detailed", "--result-dir", work,
      "--result-filename", "rollout.json", "--dump-schedule", os.path.join(work, "ro.csv"), "--requests-csv",
      os.path.join(work, "ro-req.csv"))
r3 = load("rollout.json")
rows3 = schedule("ro.csv")
check_balances(r3, "rollout", 4)
want3 = [6 * int(x["output_len"]) for x in rows3]
if r3["output_lens"] != want3 or r3["total_input_tokens"] != sum(2 * int(x["input_len"]) for x in rows3):
    reflib.fail(f"rollout tokens {r3['output_lens']} != groups x n x drawn {want3}")
ro = r3["rollout"]
if ro["samples"] != 4 * 6 or ro["samples_without_tokens"] != 0 or ro["samples_with_tpot"] != 4 * 6 or \
        [g["requests"] for g in r3["per_adapter"]] != [2, 1, 1]:
    reflib.fail(f"rollout: {ro}, per adapter {[(g['adapter'], g['requests']) for g in r3['per_adapter']]}")
if any(not isinstance(ro[k], float) for k in ("mean_server_ttft_ms", "p99_server_e2e_ms", "median_server_tpot_ms")):
    reflib.fail(f"rollout: the server-side statistics: {ro}")
# one chunk per group: no TPOT or ITL is measured, so none may be reported and a TPOT bound (here
# one no real request meets) is not applicable; it does not pass
if not r3.get("tpot_itl", "").startswith("not measured in rollout mode") or \
        any(r3[k] is not None for k in ("mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                                        "p99_itl_ms")) or any(i is not None for i in r3["itls"]) or \
        any(g["mean_tpot_ms"] is not None for g in r3["per_adapter"] + r3["per_rank"]):
    reflib.fail(f"rollout: TPOT/ITL reported: tpot_itl {r3.get('tpot_itl')!r}, mean_tpot_ms {r3['mean_tpot_ms']}, "
                f"itls {r3['itls']}")
att3 = r3["slo_attainment"]
if "tpot" not in att3 or att3["tpot"] is not None or r3["slo"].get("not_applicable") != ["tpot"] or \
        r3["slo"].get("tpot_ms") != 0.001 or att3["requests"] != 4 or att3["all"] != att3["good"] / 4 or \
        "ttft" not in att3:
    reflib.fail(f"rollout: the TPOT bound must be reported as not applicable: slo {r3['slo']}, attainment {att3}")
with open(os.path.join(work, "ro-req.csv")) as f:
    if any(x["tpot_ms"] for x in csv.DictReader(f)):
        reflib.fail("rollout: the requests CSV reports a TPOT")
if r3["request_rate"] != "inf" or r3["arrival"] != "all-at-once":
    reflib.fail(f"rollout: request_rate {r3['request_rate']!r}, arrival {r3['arrival']!r}")
p = bench("--model", "base", "--endpoint", "/v1/rollout", "--goodput", "tpot:50", "--num-prompts", "1", "--dry-run", rc=2)
if "TPOT is not measured" not in p.stderr:
    reflib.fail(f"rollout with a TPOT-only bound: {p.stderr}")
p = bench("--model", "base", "--endpoint", "/v1/rollout", "--rollout-groups", "100000", "--rollout-n", "100000",
          "--random-input-len", "30000", "--random-output-len", "1000", "--num-prompts", "1", "--dry-run", rc=2)
if "more than 2147483647" not in p.stderr:
    reflib.fail(f"a rollout call of 3e9 prompt tokens: {p.stderr}")
print(f"ok  rollout: 4 calls x 2 groups x n=3, {r3['total_output_tokens']} tokens as drawn; no TPOT or ITL, the TPOT "
      f"bound not applicable; a TPOT-only bound and an int-overflowing call refused")


class ScriptedRollout(http.server.BaseHTTPRequestHandler):
    """/v1/rollout with fixed answers: adapter "good" gets a sample of 3 tokens (server ttft 10 ms,
    e2e 30 ms) and one that produced none (-1, -1); adapter "bad" a sample that finished with
    'error' (ttft 5 ms): that call fails"""
    protocol_version = "HTTP/1.0"

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        gid = req["groups"][0]["group_id"]
        if req.get("adapter") == "good":
            samples = [{"output_ids": [1, 2, 3], "finish_reason": "length", "timing": {"ttft_ms": 10, "e2e_ms": 30}},
                       {"output_ids": [], "finish_reason": "length", "timing": {"ttft_ms": -1, "e2e_ms": -1}}]
        else:
            samples = [{"output_ids": [1], "finish_reason": "error", "timing": {"ttft_ms": 5, "e2e_ms": 5}}]
        body = (json.dumps({"group_id": gid, "samples": samples}) + "\n" +
                json.dumps({"summary": {"output_tokens": sum(len(x["output_ids"]) for x in samples)}}) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ScriptedRollout)
threading.Thread(target=fake.serve_forever, daemon=True).start()
bench("--model", "base", "--endpoint", "/v1/rollout", "--lora-modules", "good:8", "bad:8", "--popularity",
      "round-robin", "--rollout-n", "2", "--num-prompts", "4", "--random-input-len", "4", "--random-output-len", "3",
      "--metric-percentiles", "50", "--save-result", "--result-dir", work, "--result-filename", "ro-fake.json",
      base=f"http://127.0.0.1:{fake.server_address[1]}")
fake.shutdown()
rf = load("ro-fake.json")
got = {k: rf["rollout"][k] for k in ("samples", "samples_without_tokens", "samples_with_tpot", "mean_server_ttft_ms",
                                      "p50_server_ttft_ms", "mean_server_e2e_ms", "mean_server_tpot_ms")}
want = {"samples": 4, "samples_without_tokens": 2, "samples_with_tpot": 2, "mean_server_ttft_ms": 10,
        "p50_server_ttft_ms": 10, "mean_server_e2e_ms": 30, "mean_server_tpot_ms": 10}
if rf["completed"] != 2 or rf["failed"] != 2 or got != want:
    reflib.fail(f"scripted rollout: {rf['completed']} completed, {rf['failed']} failed; server statistics {got}, "
                f"want {want} (no -1 sample, no failed call's sample)")
print("ok  rollout server timing: samples without tokens and failed calls' samples left out")

# ---- 4. failures ----
bench("--model", "base", "--lora-modules", "nosuch:8", "a8:8", "--num-prompts", "12", "--request-rate", "inf",
      "--random-input-len", "8", "--random-output-len", "4", "--seed", "1", "--goodput", "e2el:600000",
      "--save-result", "--save-detailed", "--result-dir", work, "--result-filename", "fail.json",
      "--dump-schedule", os.path.join(work, "fail.csv"))
r4 = load("fail.json")
rows4 = schedule("fail.csv")
bad = sum(x["model"] == "nosuch" for x in rows4)
if bad == 0 or bad == 12:
    reflib.fail(f"seed 1 sent {bad} of 12 requests to the missing adapter; pick another seed")
check_balances(r4, "failures", 12, want_failed=bad)
nos = [g for g in r4["per_adapter"] if g["adapter"] == "nosuch"][0]
if nos["failed"] != bad or nos["completed"] != 0 or nos["slo_attainment"]["all"] != 0:
    reflib.fail(f"the missing adapter's row: {nos}")
if abs(r4["slo_attainment"]["all"] - (12 - bad) / 12) > 1e-9:
    reflib.fail(f"attainment {r4['slo_attainment']} does not count the {bad} failures as misses")
errs = [e for e in r4["errors"] if e]
if len(errs) != bad or not all(e.startswith("HTTP 404") for e in errs):
    reflib.fail(f"errors: {errs}")
p = bench("--model", "base", "--num-prompts", "3", "--save-result", "--result-dir", work, "--result-filename",
          "closed.json", rc=1, base="http://127.0.0.1:1")
r5 = load("closed.json")
if r5["completed"] != 0 or r5["failed"] != 3 or "no request completed" not in p.stderr:
    reflib.fail(f"closed port: {r5['completed']} completed, {r5['failed']} failed\n{p.stderr}")
print(f"ok  failures: {bad} requests to a missing adapter fail with 404 and count as SLO misses; a closed port: exit 1")

# ---- 5. documentation ----
src = open(os.path.join(reflib.SRCDIR, "bench", "caraserve_bench.c")).read()
flags = sorted(set(re.findall(r'arg_is\([^,]+, "(--[a-z0-9-]+)"\)', src)))
helptext = subprocess.run([BENCH, "--help"], capture_output=True, text=True).stdout
readme = open(os.path.join(reflib.SRCDIR, "bench", "README.md")).read()
missing = [f for f in flags if f not in helptext]
undocumented = [f for f in flags if f not in readme]
if len(flags) < 50 or missing or undocumented:
    reflib.fail(f"{len(flags)} flags; not in --help: {missing}; not in bench/README.md: {undocumented}")
print(f"ok  --help and bench/README.md document all {len(flags)} flags")
srv.stop()
