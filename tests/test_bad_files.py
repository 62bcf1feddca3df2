"""test_bad_files.py: `caraserve generate` on broken models and adapters must exit non-zero
(1, never a signal), print one clear error naming the file/tensor/field at fault, and not
crash: truncated and oversized safetensors headers, garbage headers, unknown dtypes,
offsets out of bounds, wrong shapes, missing tensors and shards, bad config.json, refused
adapter options, bad tokenizer.json. Standard library only (runs under ASan builds too)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

root = tempfile.mkdtemp(prefix="cs_bad_")
good = os.path.join(root, "good")
subprocess.run([reflib.MKMODEL, "model", "--out", good, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--kv-heads", "2", "--intermediate", "96", "--vocab", "300", "--dtype", "bf16"], check=True,
               capture_output=True)
good_lora = os.path.join(root, "good_lora")
subprocess.run([reflib.MKMODEL, "adapter", "--model", good, "--out", good_lora, "--rank", "4"], check=True,
               capture_output=True)
failures = []
n_cases = 0


def clone(src, name):
    d = os.path.join(root, name)
    shutil.copytree(src, d)
    return d


def run(model, lora=None, extra=()):
    cmd = [reflib.CARASERVE, "generate", "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", *extra]
    if lora:
        cmd += ["--lora", lora]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def expect_error(name, model, must, lora=None, extra=()):
    global n_cases
    n_cases += 1
    p = run(model, lora, extra)
    err = p.stderr.strip()
    if p.returncode < 0 or p.returncode > 2:
        failures.append(f"{name}: crashed or odd exit {p.returncode}: {err[-500:]}")
    elif p.returncode == 0:
        failures.append(f"{name}: accepted a broken input")
    elif any(m not in err for m in must):
        failures.append(f"{name}: error does not mention {must}: {err!r}")
    elif "AddressSanitizer" in err or "runtime error" in err:
        failures.append(f"{name}: sanitizer report: {err[-500:]}")
    else:
        print(f"ok  {name}: {err.splitlines()[-1] if err else ''}")


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        data = f.read()
    return h, data


def write(path, h, data, pad=True):
    hb = json.dumps(h).encode()
    if pad:
        hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


# sanity: the good files work
p = run(good, good_lora)
if p.returncode != 0:
    reflib.fail(f"good model failed: {p.stderr}")

ST = "model.safetensors"
h0, d0 = header(os.path.join(good, ST))
T = "model.layers.1.mlp.down_proj.weight"

m = clone(good, "trunc")
with open(os.path.join(m, ST), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(m, ST)) - 1000)
expect_error("truncated data", m, [ST])

m = clone(good, "trunc_header")
with open(os.path.join(m, ST), "r+b") as f:
    f.truncate(40)
expect_error("truncated header", m, [ST])

m = clone(good, "tiny")
with open(os.path.join(m, ST), "wb") as f:
    f.write(b"\x01\x02\x03")
expect_error("file shorter than the length prefix", m, [ST])

m = clone(good, "oversized")
with open(os.path.join(m, ST), "r+b") as f:
    f.write(struct.pack("<Q", 1 << 40))
expect_error("header length larger than the file", m, [ST])

m = clone(good, "garbage")
write(os.path.join(m, ST), None, b"")
with open(os.path.join(m, ST), "wb") as f:
    f.write(struct.pack("<Q", 16) + b"{not json at all")
expect_error("header not JSON", m, [ST])

m = clone(good, "dtype")
h = json.loads(json.dumps(h0))
h[T]["dtype"] = "Q4_K"
write(os.path.join(m, ST), h, d0)
expect_error("unknown dtype", m, [T])

m = clone(good, "i32")
h = json.loads(json.dumps(h0))
h[T]["dtype"] = "I16"
write(os.path.join(m, ST), h, d0)
expect_error("integer dtype for a weight", m, [T])

m = clone(good, "offsets")
h = json.loads(json.dumps(h0))
b, e = h[T]["data_offsets"]
h[T]["data_offsets"] = [b + len(d0), e + len(d0)]
write(os.path.join(m, ST), h, d0)
expect_error("offsets out of bounds", m, [T])

m = clone(good, "size")
h = json.loads(json.dumps(h0))
h[T]["shape"] = [h[T]["shape"][0], h[T]["shape"][1] + 1]
write(os.path.join(m, ST), h, d0)
expect_error("shape disagrees with byte size", m, [T])

m = clone(good, "overlap")
h = json.loads(json.dumps(h0))
other = "model.layers.1.mlp.up_proj.weight"
h[other]["data_offsets"] = h[T]["data_offsets"]
h[other]["shape"] = h[T]["shape"]
write(os.path.join(m, ST), h, d0)
expect_error("overlapping tensors", m, ["overlap"])

m = clone(good, "wrongshape")
h = json.loads(json.dumps(h0))
# a consistent file whose tensor has the wrong shape for the model
h[T]["shape"] = list(reversed(h[T]["shape"]))
write(os.path.join(m, ST), h, d0)
expect_error("wrong shape for the model", m, [T, "[64, 96]", "[96, 64]"])

m = clone(good, "missing")
h = json.loads(json.dumps(h0))
del h["model.layers.0.self_attn.k_proj.weight"]
write(os.path.join(m, ST), h, d0)
expect_error("missing tensor", m, ["model.layers.0.self_attn.k_proj.weight"])

m = clone(good, "noweights")
os.unlink(os.path.join(m, ST))
expect_error("no safetensors file", m, ["model.safetensors"])

m = clone(good, "shards")
shutil.rmtree(m)
subprocess.run([reflib.MKMODEL, "model", "--out", m, "--hidden", "64", "--layers", "2", "--heads", "4",
                "--intermediate", "96", "--vocab", "300", "--shards", "2"], check=True, capture_output=True)
p = run(m)
if p.returncode != 0:
    failures.append(f"sharded model failed: {p.stderr}")
shard = sorted(f for f in os.listdir(m) if f.startswith("model-0000"))[1]
os.unlink(os.path.join(m, shard))
expect_error("missing shard", m, [shard])

m = clone(good, "cfg_arch")
reflib_cfg = os.path.join(m, "config.json")
c = json.load(open(reflib_cfg))
c["architectures"] = ["GPT2LMHeadModel"]
json.dump(c, open(reflib_cfg, "w"))
expect_error("unsupported architecture", m, ["GPT2LMHeadModel"])

m = clone(good, "cfg_rope")
c = json.load(open(os.path.join(m, "config.json")))
c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
json.dump(c, open(os.path.join(m, "config.json"), "w"))
expect_error("unsupported rope scaling", m, ["yarn"])

m = clone(good, "cfg_field")
c = json.load(open(os.path.join(m, "config.json")))
del c["hidden_size"]
json.dump(c, open(os.path.join(m, "config.json"), "w"))
expect_error("missing config field", m, ["hidden_size"])

m = clone(good, "cfg_json")
open(os.path.join(m, "config.json"), "w").write("{\"architectures\": [")
expect_error("config.json not JSON", m, ["config.json"])

# adapters
lc = os.path.join(good_lora, "adapter_config.json")
for name, edit, must in [
    ("DoRA adapter", lambda c: c.update(use_dora=True), ["DoRA"]),
    ("modules_to_save", lambda c: c.update(modules_to_save=["lm_head"]), ["modules_to_save"]),
    ("lm_head LoRA", lambda c: c.update(target_modules=["q_proj", "lm_head"]), ["lm_head"]),
    ("embedding LoRA", lambda c: c.update(target_modules=["embed_tokens"]), ["embed_tokens"]),
    ("rank mismatch", lambda c: c.update(r=8), ["lora_A"]),
]:
    a = clone(good_lora, "lora_" + name.replace(" ", "_"))
    c = json.load(open(lc))
    edit(c)
    json.dump(c, open(os.path.join(a, "adapter_config.json"), "w"))
    expect_error(name, good, must, lora=a)

a = clone(good_lora, "lora_shape")
ah, ad = header(os.path.join(a, "adapter_model.safetensors"))
key = next(k for k in ah if k.endswith("q_proj.lora_B.weight"))
ah[key]["shape"] = list(reversed(ah[key]["shape"]))
write(os.path.join(a, "adapter_model.safetensors"), ah, ad)
expect_error("adapter tensor of the wrong shape", good, [key, "[4, 64]", "[64, 4]"], lora=a)

a = clone(good_lora, "lora_missing")
ah2, ad2 = header(os.path.join(good_lora, "adapter_model.safetensors"))
del ah2[key]
write(os.path.join(a, "adapter_model.safetensors"), ah2, ad2)
expect_error("adapter tensor missing", good, [key], lora=a)

# other models' adapters: a different hidden size
other = os.path.join(root, "other")
subprocess.run([reflib.MKMODEL, "model", "--out", other, "--hidden", "32", "--layers", "2", "--heads", "4",
                "--intermediate", "48", "--vocab", "300"], check=True, capture_output=True)
expect_error("adapter for another base model", other, ["expected"], lora=good_lora)

# tokenizer
m = clone(good, "tok")
open(os.path.join(m, "tokenizer.json"), "w").write("{\"model\": {\"type\": \"Unigram\"}")
expect_error("broken tokenizer.json", m, ["tokenizer"], extra=())

expect_error("prompt id beyond the vocabulary", good, ["vocab"], extra=("--prompt-ids", "5,99999"))

shutil.rmtree(root, ignore_errors=True)
if failures:
    print("\n".join("FAIL " + f for f in failures))
    sys.exit(1)
print(f"PASS: {n_cases} broken inputs rejected cleanly")
