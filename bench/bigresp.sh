#!/usr/bin/env bash
# bench/bigresp.sh: what large responses cost the server's memory. A small
# Llama (hidden 128, 2 layers, the 32k tokenizer) serves completions of 16 prompts of 2,000
# tokens each with echo and logprobs 20 (about 20 MB of JSON each): one, then six at once.
# The server's RSS (VmRSS) is sampled before, after each round, and after it has been idle for
# IDLE seconds; its peak is VmHWM. Writes bench/results/bigresp-*.json.
#
#   bench/bigresp.sh
# Env: BUILD (build), THREADS (2), PROMPTS (16), LEN (2000), TOP (20), CONCURRENT (6), IDLE (3),
# COMMIT (recorded in the result; default: this checkout's, for a BUILD made from another)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build} THREADS=${THREADS:-2} PROMPTS=${PROMPTS:-16} LEN=${LEN:-2000} TOP=${TOP:-20}
CONCURRENT=${CONCURRENT:-6} IDLE=${IDLE:-3}
CACHE=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/caraserve-bench}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$CACHE" bench/results
tok="$CACHE/spm-32k"
if [ ! -f "$tok/tokenizer.json" ]; then
    mkdir -p "$tok"
    xz -dc tests/data/tokenizers/spm-32k/tokenizer.json.xz > "$tok/tokenizer.json"
    cp tests/data/tokenizers/spm-32k/tokenizer_config.json "$tok/"
fi
model="$CACHE/llama-tiny-128"
[ -f "$model/config.json" ] || "$BUILD/caraserve-mkmodel" model --out "$model" --arch llama --hidden 128 --layers 2 \
    --heads 2 --intermediate 256 --vocab 32000 --dtype f32 --seed 3 --tokenizer "$tok" >&2
port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BUILD/caraserve" serve --model "$model" --served-model-name m --port "$port" --threads "$THREADS" \
    --kv-cache-bytes 512M --max-model-len $((LEN + 8)) --max-logprobs "$TOP" --max-body-bytes 64M 2> /dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.2; done
$PY - "$port" "$pid" "$PROMPTS" "$LEN" "$TOP" "$CONCURRENT" "$IDLE" "$BUILD" <<'PYEOF'
import http.client, json, os, random, subprocess, sys, threading, time
port, pid, prompts, length, top, conc, idle, build = sys.argv[1:9]
port, prompts, length, top, conc, idle = int(port), int(prompts), int(length), int(top), int(conc), float(idle)
def status(key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
rng = random.Random(1)
body = json.dumps({"model": "m", "prompt": [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(prompts)],
                   "max_tokens": 1, "echo": True, "logprobs": top, "temperature": 0}).encode()
sizes = []
def one():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise SystemExit(f"bigresp: {r.status} {data[:300]!r}")
    sizes.append(len(data))
    c.close()
rss = {"before": status("VmRSS")}
one()
rss["after_one"] = status("VmRSS")
time.sleep(idle)
rss["idle_after_one"] = status("VmRSS")
ths = [threading.Thread(target=one) for _ in range(conc)]
for t in ths: t.start()
for t in ths: t.join()
rss[f"after_{conc}_at_once"] = status("VmRSS")
time.sleep(idle)
rss[f"idle_after_{conc}_at_once"] = status("VmRSS")
rss["peak"] = status("VmHWM")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
def git(*a):
    try: return subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    except OSError: return ""
commit = os.environ.get("COMMIT") or (git("rev-parse", "--short", "HEAD") +
                                       ("+changes" if git("status", "--porcelain", "--untracked-files=no") else ""))
res = {"benchmark": "bigresp", "cpu": cpu, "commit": commit, "prompts": prompts, "prompt_tokens": length,
       "logprobs": top, "response_bytes": max(sizes), "concurrent": conc, "idle_s": idle,
       "rss_bytes": rss, "rss_growth_one_per_response_byte": (rss["after_one"] - rss["before"]) / max(sizes)}
stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
out = f"bench/results/bigresp-{stamp}.json"
json.dump(res, open(out, "w"), indent=2)
for k, v in rss.items():
    print(f"{k:24s} {v / 2**20:8.1f} MiB")
print(f"response {max(sizes) / 2**20:.1f} MiB; {out}")
PYEOF
"$PY" bench/machine.py "$(ls -t bench/results/bigresp-*.json | head -1)" "$BUILD/caraserve" || true   # the CPU, its ISA, the kernel paths
