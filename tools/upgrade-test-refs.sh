#!/usr/bin/env bash
# tools/upgrade-test-refs.sh: move the pinned test references (tests/requirements.txt) to the
# newest releases, then run the whole suite against them.
#
#   tools/upgrade-test-refs.sh            newest transformers, peft, tokenizers, kubernetes-validate, ... (torch stays 2.13.0)
#   tools/upgrade-test-refs.sh peft==0.22.0   extra constraints for the resolver
#
# It resolves in a scratch virtual environment, rewrites the pins of tests/requirements.txt
# (its comments kept), and runs ./quickstart test, which reinstalls .venv from the new file.
# Commit the new file on its own, and only when the suite passed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REFS="torch==2.13.0 transformers peft tokenizers safetensors jinja2 openai numpy kubernetes-validate lark"
scratch=$(mktemp -d /tmp/cs-refs.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
python3 -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install -q --disable-pip-version-check $REFS "$@"
"$scratch/venv/bin/pip" freeze --all --exclude pip --exclude setuptools --exclude wheel \
    | sed -e 's/+cpu$//' > "$scratch/freeze"
python3 - "$scratch/freeze" tests/requirements.txt <<'PY'
import re, sys
frozen = {re.split("==", l)[0].lower().replace("_", "-"): l.strip() for l in open(sys.argv[1]) if "==" in l}
out, seen = [], set()
for line in open(sys.argv[2]):
    m = re.match(r"([A-Za-z0-9_.-]+)==", line)
    if not m:
        out.append(line)
        continue
    key = m.group(1).lower().replace("_", "-")
    if key in frozen:
        out.append(frozen[key] + "\n")
        seen.add(key)
new = [v for k, v in sorted(frozen.items()) if k not in seen]
out += [v + "\n" for v in new]
open(sys.argv[2], "w").writelines(out)
PY
git --no-pager diff --stat -- tests/requirements.txt || true
git --no-pager diff -U0 -- tests/requirements.txt | grep '^[-+][^-+]' || echo "(no change)"
./quickstart test
echo "the suite passed on the new references: commit tests/requirements.txt on its own"
