"""test_first_answer.py: the first thing a new user does. `./quickstart serve` serves the demo
model (SmolLM2-135M-Instruct, real weights) with the sampling its generation_config.json
recommends (temperature 0.2, top_p 0.9, which the quickstart writes there), and requests that
leave sampling fields out get those, as vLLM's --generation-config auto does. Asked over chat
"What is the capital of France?" with no sampling fields and seeds 0-9:

- each answer is the one the same request with temperature 0.2 and top_p 0.9 gives (the
  model's defaults are applied, and nothing else changes);
- with --generation-config vllm the same seeds sample at vLLM's temperature 1.0: other answers;
- a request's own temperature 0 wins: one greedy answer for every seed, naming Paris.

How many of the ten default answers name Paris is printed, not asserted: this Q4_1 checkpoint
puts "The" and "L" nearly level as the answer's first token (logprobs -1.883 and -1.965,
exact against transformers), so at temperature 0.2 about 6 in 10 start "The capital of France
is Paris". Skipped (77) without the demo model (CS_DEMO_MODEL).

The quickstart serves the demo's GGUF file as it comes (CS_DEMO_GGUF): its Q4_1 weights,
tokenizer and chat template read from the file. Served with the directory's generation config,
it must give the same ten answers and the same greedy one as the directory (F32 weights
dequantized from that file): the same tokens in, the same values computed in F32 (in another
summation order, far below what moves a sample)."""
import json
import os
import sys

import reflib
from serverlib import Server

demo = os.environ.get("CS_DEMO_MODEL", "")
gen_path = os.path.join(demo, "generation_config.json")
if not demo or not os.path.isfile(os.path.join(demo, "config.json")) or "smollm2" not in os.path.basename(demo):
    print("SKIP: CS_DEMO_MODEL is not the SmolLM2 demo model (./quickstart test sets it)")
    sys.exit(77)
gen = json.load(open(gen_path))
if gen.get("temperature") != 0.2 or gen.get("top_p") != 0.9:
    reflib.fail(f"{gen_path} does not carry SmolLM2's recommended sampling (the quickstart writes it): {gen}")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def answers(srv, extra=None):
    out = []
    for seed in range(10):
        body = {"model": "demo", "messages": QUESTION, "seed": seed, "max_tokens": 64}
        body.update(extra or {})
        st, r, _ = srv.request("POST", "/v1/chat/completions", body)
        if st != 200:
            reflib.fail(f"seed {seed}: HTTP {st}: {r}")
        out.append(r["choices"][0]["message"]["content"])
    return out


srv = Server(["--model", demo, "--served-model-name", "demo", "--kv-cache-bytes", "256M"])
try:
    first = answers(srv)
    explicit = answers(srv, {"temperature": 0.2, "top_p": 0.9})
    greedy = answers(srv, {"temperature": 0})
finally:
    srv.stop()
for seed, a in enumerate(first):
    print(f"seed {seed}: {a!r}")
print(f"{sum('Paris' in a for a in first)} of 10 default answers name Paris")
if first != explicit:
    reflib.fail("the default answers are not those of temperature 0.2, top_p 0.9: the model's generation_config.json "
                f"was not applied\n{first}\n{explicit}")
# temperature 0 in the request wins over the model's 0.2: every seed gives the same answer
if len(set(greedy)) != 1 or "Paris" not in greedy[0]:
    reflib.fail(f"temperature 0 in the request did not give one greedy answer naming Paris: {set(greedy)}")
print(f"greedy: {greedy[0]!r}")

# without the model's defaults the same seeds sample at temperature 1.0: other answers
srv = Server(["--model", demo, "--served-model-name", "demo", "--kv-cache-bytes", "256M",
              "--generation-config", "vllm"])
try:
    plain = answers(srv)
finally:
    srv.stop()
if plain == first:
    reflib.fail("--generation-config vllm gave the same answers as the model's defaults")
print(f"--generation-config vllm: {sum('Paris' in a for a in plain)} of 10 name Paris")

gguf = os.environ.get("CS_DEMO_GGUF", "")
if gguf and os.path.isfile(gguf):
    srv = Server(["--model", gguf, "--served-model-name", "demo", "--kv-cache-bytes", "256M",
                  "--generation-config", demo])
    try:
        g_first = answers(srv)
        g_greedy = answers(srv, {"temperature": 0})
    finally:
        srv.stop()
    if g_greedy != greedy:
        reflib.fail(f"the GGUF's greedy answer differs from the directory's:\n{g_greedy[0]!r}\n{greedy[0]!r}")
    if g_first != first:
        reflib.fail(f"the GGUF's default answers differ from the directory's:\n{g_first}\n{first}")
    print(f"the demo GGUF ({os.path.basename(gguf)}) served as it comes gives the same 10 answers and greedy answer")
else:
    print("note: CS_DEMO_GGUF not set: the demo GGUF file is not served")
print("PASS")
