#!/bin/sh
# check.sh: the fuzz targets in make check. Each runs its seed corpus (tests/fuzz/corpus/T),
# the inputs that once crashed it (tests/fuzz/regressions/T) and CS_FUZZ_MUTATIONS (default
# 3000) inputs mutated from them with a fixed seed: the same inputs on every machine, under
# the build's sanitizers (CI: ASan + UBSan). tests/fuzz/run.sh does the coverage-guided
# fuzzing with libFuzzer.
set -u
src=${CS_SRCDIR:?CS_SRCDIR not set}
build=${CS_BUILDDIR:?CS_BUILDDIR not set}
if [ "${CS_FUZZ_KIND:-driver}" = libfuzzer ]; then
    echo "SKIP: a libFuzzer build (tests/fuzz/run.sh runs these)"
    exit 77
fi
mutations=${CS_FUZZ_MUTATIONS:-3000}
targets="completions chat rollout safetensors model_config adapter_config tokenizer_json tokenizer chat_template
 config_file stream gbnf regex schema lark keys gguf gguf_tokenizer"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
for t in $targets; do
    bin=$build/tests/fuzz/fuzz_$t
    set -- "$src/tests/fuzz/corpus/$t"
    [ -d "$src/tests/fuzz/regressions/$t" ] && set -- "$@" "$src/tests/fuzz/regressions/$t"
    # (a hang is a finding too: no target takes a minute on its own)
    if (cd "$work" && CS_FUZZ_BUILDDIR=$build timeout 600 "$bin" -mutations="$mutations" "$@") > "$work/$t.log" 2>&1; then
        tail -n 1 "$work/$t.log"
    else
        echo "FAIL: fuzz_$t"
        tail -n 40 "$work/$t.log"
        [ -f "$work/fuzz-crash-fuzz_$t" ] && { echo "the input, base64:"; base64 "$work/fuzz-crash-fuzz_$t"; }
        failed=1
    fi
done
exit $failed
