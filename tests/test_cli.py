"""test_cli.py: the `caraserve` command line itself: usage errors exit 2 with a message,
--help exits 0, sampling with a seed is reproducible and differs across seeds, greedy is the
default, --max-tokens 0 only scores the prompt, --no-special drops the BOS token, and
--reference-kernels gives the same tokens as the fast kernels, as do --mmap and --no-mmap;
`caraserve batch` usage errors, bad request lines and a missing requests file. Standard library only."""
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

root = tempfile.mkdtemp(prefix="cs_cli_")
tok = os.path.join(root, "tok")
os.makedirs(tok)
src = os.path.join(reflib.SRCDIR, "tests", "data", "tokenizers", "spm-32k")
with lzma.open(os.path.join(src, "tokenizer.json.xz")) as f, open(os.path.join(tok, "tokenizer.json"), "wb") as g:
    shutil.copyfileobj(f, g)
shutil.copy(os.path.join(src, "tokenizer_config.json"), tok)
model = os.path.join(root, "m")
subprocess.run([reflib.MKMODEL, "model", "--out", model, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--intermediate", "96", "--dtype", "bf16", "--tokenizer", tok, "--init-std", "0.1"],
               check=True, capture_output=True)
failures = []


def cs(*args):
    return subprocess.run([reflib.CARASERVE, *args], capture_output=True, text=True, timeout=120)


def expect(name, cond, p):
    if cond:
        print(f"ok  {name}")
    else:
        failures.append(f"{name}: exit {p.returncode}\nstdout: {p.stdout[-400:]}\nstderr: {p.stderr[-400:]}")


for name, args in [
    ("no command", []),
    ("unknown command", ["frobnicate"]),
    ("unknown flag", ["generate", "--model", model, "--prompt", "x", "--bogus"]),
    ("missing --model", ["generate", "--prompt", "x"]),
    ("neither prompt", ["generate", "--model", model]),
    ("both prompts", ["generate", "--model", model, "--prompt", "x", "--prompt-ids", "1"]),
    ("bad --max-tokens", ["generate", "--model", model, "--prompt", "x", "--max-tokens", "ten"]),
    ("negative --temperature", ["generate", "--model", model, "--prompt", "x", "--temperature", "-1"]),
    ("bad --threads", ["generate", "--model", model, "--prompt", "x", "--threads", "0"]),
    ("bad --prompt-ids", ["generate", "--model", model, "--prompt-ids", "1,abc"]),
    ("stray argument", ["generate", "--model", model, "--prompt", "x", "extra"]),
    ("batch: missing --model", ["batch"]),
    ("batch: unknown flag", ["batch", "--model", model, "--bogus"]),
    ("batch: --lora without NAME=", ["batch", "--model", model, "--lora", "/tmp/x"]),
    ("batch: bad --kv-cache-bytes", ["batch", "--model", model, "--kv-cache-bytes", "lots"]),
    ("batch: bad --kv-cache-fraction", ["batch", "--model", model, "--kv-cache-fraction", "2"]),
    ("batch: bad --max-num-seqs", ["batch", "--model", model, "--max-num-seqs", "0"]),
    ("batch: bad --lora-io", ["batch", "--model", model, "--lora-io", "fast"]),
    ("serve: bad --lora-io", ["serve", "--model", model, "--lora-io", "mmap"]),
    ("bad --precision", ["generate", "--model", model, "--prompt", "x", "--precision", "fp8"]),
    ("batch: bad --precision", ["batch", "--model", model, "--precision", "half"]),
    ("serve: bad --precision", ["serve", "--model", model, "--precision", "BF16"]),
    ("bad --kv-cache-dtype", ["generate", "--model", model, "--prompt", "x", "--kv-cache-dtype", "fp8"]),
    ("batch: bad --kv-cache-dtype", ["batch", "--model", model, "--kv-cache-dtype", "f16"]),
    ("serve: bad --kv-cache-dtype", ["serve", "--model", model, "--kv-cache-dtype", "BF16"]),
    ("serve: --slo-headroom over 1", ["serve", "--model", model, "--slo-headroom", "1.5"]),
    ("serve: --slo-headroom not a number", ["serve", "--model", model, "--slo-headroom", "most"]),
]:
    p = cs(*args)
    expect(f"usage error: {name} -> exit 2", p.returncode == 2 and p.stderr.strip() != "", p)

# --precision bf16 names itself in the kernel path (--stats), and exact is the default
for prec in ("bf16", "exact"):
    p = cs("generate", "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--stats", "--precision", prec)
    path = re.search(r"\(([^ ]+) kernels", p.stderr)
    expect(f"generate --precision {prec}: the kernel path says so",
           p.returncode == 0 and path and ("bf16" in path.group(1).split("+")) == (prec == "bf16"), p)

# the KV cache's dtype: auto is F32 in the exact mode and BF16 under --precision bf16 (BF16
# weights: an F32 model's matmuls are exact either way, and so is its cache); a flag overrides
# either; --stats says which (generate and batch)
model32 = os.path.join(root, "m32")
subprocess.run([reflib.MKMODEL, "model", "--out", model32, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--intermediate", "96", "--dtype", "f32", "--tokenizer", tok], check=True, capture_output=True)
p = cs("generate", "--model", model32, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--stats", "--precision", "bf16")
expect("generate --precision bf16 on F32 weights: KV F32", p.returncode == 0 and "| KV F32 |" in p.stderr, p)
for prec, kv, want in (("exact", None, "F32"), ("bf16", None, "BF16"), ("exact", "bf16", "BF16"), ("bf16", "f32", "F32")):
    extra = ["--kv-cache-dtype", kv] if kv else []
    p = cs("generate", "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--stats", "--precision", prec,
           *extra)
    expect(f"generate --precision {prec} {' '.join(extra)}: KV {want}", p.returncode == 0 and f"| KV {want} |" in p.stderr, p)
    p = subprocess.run([reflib.CARASERVE, "batch", "--model", model, "--precision", prec, "--stats", *extra],
                       input='{"prompt_ids": [1, 2, 3], "max_tokens": 2}\n', capture_output=True, text=True, timeout=120)
    st = next((json.loads(line) for line in p.stderr.splitlines() if line.startswith("{")), {})
    expect(f"batch --precision {prec} {' '.join(extra)}: kv_dtype {want}", p.returncode == 0 and st.get("kv_dtype") == want, p)

# on the CUDA backend (its code on the host emulator) BF16 weights are BF16 GEMMs, so auto keeps
# a BF16 model's K and V in BF16 without --precision, as vLLM does; F32 weights stay F32
for m, want in ((model, "BF16"), (model32, "F32")):
    p = subprocess.run([reflib.CARASERVE, "batch", "--model", m, "--stats", "--device", "cpu"],
                       input='{"prompt_ids": [1, 2, 3], "max_tokens": 2}\n', capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, CS_TEST_DEVICE="cuda-emu"))
    st = next((json.loads(line) for line in p.stderr.splitlines() if line.startswith("{")), {})
    expect(f"batch on the CUDA backend (emulated), {os.path.basename(m)}: kv_dtype {want}",
           p.returncode == 0 and st.get("kv_dtype") == want and st.get("backend", {}).get("name") == "cuda-emu", p)

p = cs("generate", "--help")
expect("generate --help exits 0 and lists --lora", p.returncode == 0 and "--lora" in p.stdout, p)
p = cs("--version")
expect("--version", p.returncode == 0 and p.stdout.startswith("caraserve "), p)
# the CPU and the kernel paths the backend picks (what bench/machine.py stamps results with),
# the environment's switches applied
kern = re.search(r"^kernels: (\S+) \(exact\), (\S+) \(--precision bf16\)$", p.stdout, re.M)
expect("--version names the CPU and both kernel paths",
       re.search(r"^cpu: .+ \(.*\)$", p.stdout, re.M) is not None and kern is not None
       and "bf16" in kern.group(2).split("+") and "bf16" not in kern.group(1).split("+"), p)
flags = open("/proc/cpuinfo").read()
if " avx2" in flags:
    p2 = subprocess.run([reflib.CARASERVE, "version"], capture_output=True, text=True,
                        env=dict(os.environ, CS_NO_AVX512="1"))
    expect("version with CS_NO_AVX512=1 names the AVX2 path",
           p2.returncode == 0 and re.search(r"^kernels: avx2\S* \(exact\)", p2.stdout, re.M) is not None, p2)
p = cs("generate", "--model", model, "--prompt-ids", "", "--max-tokens", "1")
expect("empty prompt -> exit 1", p.returncode == 1 and "empty" in p.stderr, p)


def gen_ids(*extra):
    p = cs("generate", "--model", model, "--prompt", "Hello world", "--max-tokens", "12", "--ignore-eos",
           "--print-ids", *extra)
    if p.returncode != 0:
        failures.append(f"generate {extra}: {p.stderr}")
        return [], []
    lines = dict(l.split(":", 1) for l in p.stdout.splitlines() if l.startswith(("prompt_ids:", "generated_ids:")))
    parse = lambda s: [int(t) for t in s.strip().split(",")] if s.strip() else []  # noqa: E731
    return parse(lines["prompt_ids"]), parse(lines["generated_ids"])


prompt, greedy = gen_ids()
_, greedy2 = gen_ids("--temperature", "0")
expect("greedy is the default and deterministic", greedy and greedy == greedy2, subprocess.CompletedProcess([], 0, "", ""))
_, s1 = gen_ids("--temperature", "1.5", "--seed", "7")
_, s1b = gen_ids("--temperature", "1.5", "--seed", "7", "--threads", "1")
_, s2 = gen_ids("--temperature", "1.5", "--seed", "8")
cp = subprocess.CompletedProcess([], 0, f"{s1} {s1b} {s2} {greedy}", "")
expect("same seed, same tokens (any thread count)", s1 == s1b and len(s1) == 12, cp)
expect("another seed, other tokens", s1 != s2, cp)
expect("sampling differs from greedy", s1 != greedy or s2 != greedy, cp)
_, ref = gen_ids("--reference-kernels")
expect("reference kernels give the greedy tokens too", ref == greedy, subprocess.CompletedProcess([], 0, f"{ref} {greedy}", ""))
nospec, _ = gen_ids("--no-special")
expect("BOS added by the post-processor, dropped by --no-special",
       prompt[0] == 1 and nospec == prompt[1:], subprocess.CompletedProcess([], 0, f"{prompt} {nospec}", ""))
p = cs("generate", "--model", model, "--prompt", "Hello", "--max-tokens", "0", "--print-ids")
expect("--max-tokens 0 generates nothing", p.returncode == 0 and "generated_ids:\n" in p.stdout + "\n", p)

# batch: a bad line gets an error line, the others run; a missing requests file is exit 1
p = subprocess.run([reflib.CARASERVE, "batch", "--model", model, "--kv-cache-bytes", "4M"], capture_output=True,
                   text=True, timeout=120,
                   input='{"prompt": "Hello", "max_tokens": 3, "temperature": 0}\nnot json\n{"max_tokens": 2}\n')
lines = [json.loads(l) for l in p.stdout.splitlines()] if p.returncode == 0 else []
expect("batch: good line runs, bad lines get errors",
       len(lines) == 3 and len(lines[0]["samples"][0]["tokens"]) == 3 and "line 2" in lines[1].get("error", "")
       and "prompt" in lines[2].get("error", ""), p)
# an adapter read with O_DIRECT (the default) and through the page cache: the same tokens
ad = os.path.join(root, "ad")
subprocess.run([reflib.MKMODEL, "adapter", "--model", model, "--out", ad, "--rank", "8", "--alpha", "16", "--seed", "3",
                "--dtype", "bf16"], check=True, capture_output=True)
outs = {}
for io in ("direct", "buffered"):
    p = subprocess.run([reflib.CARASERVE, "batch", "--model", model, "--lora", f"ad={ad}", "--lora-io", io,
                        "--kv-cache-bytes", "4M", "--stats"], capture_output=True, text=True, timeout=120,
                       input='{"prompt": "Hello", "max_tokens": 6, "temperature": 0, "adapter": "ad", "ignore_eos": true}\n')
    st = [json.loads(l) for l in p.stderr.splitlines() if l.startswith("{")]
    outs[io] = ([json.loads(l)["samples"][0]["tokens"] for l in p.stdout.splitlines()],
                st[0]["lora_loads"], st[0]["lora_loads_direct"]) if p.returncode == 0 and st else p.stderr
# O_DIRECT where the file system takes it (the test's own temporary directory)
try:
    os.close(os.open(os.path.join(ad, "adapter_model.safetensors"), os.O_RDONLY | os.O_DIRECT))
    fs_direct = 1
except OSError:
    fs_direct = 0
expect(f"batch: --lora-io direct (O_DIRECT: {bool(fs_direct)}) and buffered load the same adapter (same greedy tokens)",
       isinstance(outs["direct"], tuple) and len(outs["direct"][0]) == 1 and outs["direct"][0] == outs["buffered"][0]
       and outs["direct"][1:] == (1, fs_direct) and outs["buffered"][1:] == (1, 0),
       subprocess.CompletedProcess([], 0, str(outs), ""))
# the weights in the file's mapping (--mmap) or read into the process's memory (--no-mmap):
# the same tokens, and --stats says where they were
wm = {}
for flag in ("--mmap", "--no-mmap", "--compress-weights", "--compress-weights-only"):
    p = subprocess.run([reflib.CARASERVE, "batch", "--model", model, flag, "--kv-cache-bytes", "4M", "--stats"],
                       capture_output=True, text=True, timeout=120,
                       input='{"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": true}\n')
    st = [json.loads(l) for l in p.stderr.splitlines() if l.startswith("{")]
    wm[flag] = ([json.loads(l)["samples"][0]["tokens"] for l in p.stdout.splitlines()], st[0]["weights"]) \
        if p.returncode == 0 and st else p.stderr
mfile = os.path.getsize(os.path.join(model, "model.safetensors"))
expect("batch: --mmap and --no-mmap give the same tokens; --stats: mapped, or the file's bytes copied",
       isinstance(wm["--mmap"], tuple) and isinstance(wm["--no-mmap"], tuple) and len(wm["--mmap"][0][0]) == 8
       and wm["--mmap"][0] == wm["--no-mmap"][0]
       and wm["--mmap"][1] == {"memory": "mmap", "copied_bytes": 0, "huge_page_bytes": 0, "coded_bytes": 0,
                               "coded_from_bytes": 0, "coded_exceptions": 0, "released_bytes": 0}
       and wm["--no-mmap"][1]["memory"] == "copy" and wm["--no-mmap"][1]["copied_bytes"] == mfile
       and 0 <= wm["--no-mmap"][1]["huge_page_bytes"] <= mfile, subprocess.CompletedProcess([], 0, str(wm), ""))
# --compress-weights: the same tokens; on a CPU with AVX2 or AVX-512 every BF16 matmul weight
# (2 layers x 7 projections, the tied lm_head) is coded, 192 bytes per 128 columns and a row
# index, with few exceptions
cw = wm["--compress-weights"]
ver = subprocess.run([reflib.CARASERVE, "version"], capture_output=True, text=True).stdout
avx = "avx2" in ver.split("kernels:")[0]
# --compress-weights-only keeps only the code, except on AMX CPUs (the exact path is "amx...")
code_only = avx and not ver.split("kernels:")[1].strip().startswith("amx")
cfgm = json.load(open(os.path.join(model, "config.json")))
H, I, V = cfgm["hidden_size"], cfgm["intermediate_size"], cfgm["vocab_size"]
mats = [(H, H)] * 4 * 2 + [(I, H), (I, H), (H, I)] * 2 + [(V, H)]  # q, k, v, o (MHA), gate, up, down; lm_head
want_from = sum(2 * r * c for r, c in mats)
want_data = sum(r * -(-c // 128) * 192 + 4 * (r + 1) for r, c in mats)
expect("batch --compress-weights: the same tokens; --stats counts the coded weights",
       isinstance(cw, tuple) and cw[0] == wm["--mmap"][0]
       and ((cw[1]["coded_from_bytes"] == want_from and want_data <= cw[1]["coded_bytes"] <= want_data + 8 * cw[1]["coded_exceptions"]
             and cw[1]["coded_exceptions"] < want_from / 2 / 100) if avx else cw[1]["coded_bytes"] == 0)
       and cw[1]["released_bytes"] == 0,
       subprocess.CompletedProcess([], 0, f"{cw} want from {want_from}, data {want_data}", ""))
# --compress-weights-only: the same, and the BF16 bytes given back (whole pages inside each
# weight: all but at most 8 KiB of each of the 15 matrices)
co = wm["--compress-weights-only"]
expect("batch --compress-weights-only: the same tokens; --stats counts the coded weights and the BF16 bytes released",
       isinstance(co, tuple) and co[0] == wm["--mmap"][0]
       and all(co[1][k] == cw[1][k] for k in ("coded_bytes", "coded_from_bytes", "coded_exceptions"))
       and ((want_from - 8192 * len(mats) <= co[1]["released_bytes"] <= want_from) if code_only else co[1]["released_bytes"] == 0),
       subprocess.CompletedProcess([], 0, f"{co} want from {want_from}", ""))
_, gm = gen_ids("--mmap")
_, gc = gen_ids("--no-mmap")
_, gz = gen_ids("--compress-weights")
_, go = gen_ids("--compress-weights-only")
expect("generate --compress-weights and --compress-weights-only give the greedy tokens", gz == greedy and go == greedy,
       subprocess.CompletedProcess([], 0, f"{gz} {go} {greedy}", ""))
expect("generate: --mmap and --no-mmap give the greedy tokens", gm == greedy and gc == greedy,
       subprocess.CompletedProcess([], 0, f"{gm} {gc} {greedy}", ""))
# serve: compress-weights-only = true in --config codes the weights and releases the BF16 (its
# ready line says so), and a greedy completion gives the tokens `batch` gave without it
import serverlib  # noqa: E402
conf = os.path.join(root, "cw.conf")
with open(conf, "w") as f:
    f.write(f"model = {model}\ncompress-weights-only = true\nkv-cache-bytes = 4M\n")
srv = serverlib.Server(["--config", conf])
ready = next((l for l in srv.lines if "caraserve: ready:" in l), "")
st_, body, _ = srv.request("POST", "/v1/completions", {"model": os.path.basename(model), "prompt": "Hello", "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True})
srv.kill()
p = subprocess.run([reflib.CARASERVE, "batch", "--model", model, "--kv-cache-bytes", "4M"], capture_output=True, text=True,
                   timeout=120, input='{"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": true}\n')
plain_text = json.loads(p.stdout.splitlines()[0])["samples"][0]["text"] if p.returncode == 0 and p.stdout else None
expect("serve with compress-weights-only = true in --config: the ready line counts the coded weights, the same greedy text",
       st_ == 200 and (("coded in" in ready) if avx else ("coded in" not in ready))
       and ("the BF16 released" in ready) == code_only
       and body["choices"][0]["finish_reason"] == "length" and plain_text is not None
       and body["choices"][0]["text"] == plain_text,
       subprocess.CompletedProcess([], 0, f"{ready} {st_} {body} batch without the flag: {plain_text!r}", ""))
p = cs("batch", "--model", model, "--requests", os.path.join(root, "nope.jsonl"))
expect("batch: missing requests file -> exit 1", p.returncode == 1 and "nope.jsonl" in p.stderr, p)
p = cs("batch", "--help")
expect("batch --help exits 0 and lists --kv-cache-bytes", p.returncode == 0 and "--kv-cache-bytes" in p.stdout, p)

shutil.rmtree(root, ignore_errors=True)
if failures:
    print("\n".join("FAIL " + f for f in failures))
    sys.exit(1)
print("PASS")
