#!/bin/sh
# pyrun.sh: automake log compiler for tests/*.py. Runs the script with $PYTHON (the venv
# that has torch/transformers/peft/tokenizers); without one the test is skipped (77).
if [ -z "$PYTHON" ]; then
    echo "SKIP: PYTHON is not set (configure PYTHON=/path/to/venv/bin/python to run reference tests)"
    exit 77
fi
exec "$PYTHON" "$@"
