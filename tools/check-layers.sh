#!/bin/sh
# tools/check-layers.sh SRCDIR: every #include "dir/file.h" in a layer's sources must point to
# its own layer or one the layer may use. The layers and their rules are the LAYER_<name> and
# USES_<name> lines of Makefile.am, the one table of them (README.md's source code layout); a
# file belongs to the layer whose path is the longest prefix of its own. Run by the build
# (Makefile.am's layers.stamp), so a wrong include fails `make`; prints each violation as
# FILE:LINE. tests/ may include anything.
srcdir=${1:-.}
cd "$srcdir" || exit 2
[ -f Makefile.am ] || { echo "check-layers: no Makefile.am in $srcdir" >&2; exit 2; }
# "path layer" lines, longest path first; "layer: uses..." lines
table=$(sed -n 's/^LAYER_\([a-z_]*\)[[:space:]]*=[[:space:]]*\(.*\)$/\1 \2/p' Makefile.am |
    while read -r name paths; do for p in $paths; do echo "${#p} $p $name"; done; done | sort -rn | cut -d' ' -f2-)
uses=$(sed -n 's/^USES_\([a-z_]*\)[[:space:]]*=[[:space:]]*\(.*\)$/\1: \2/p; s/^USES_\([a-z_]*\)[[:space:]]*=[[:space:]]*$/\1: /p' Makefile.am)
[ -n "$table" ] || { echo "check-layers: no LAYER_ lines in Makefile.am" >&2; exit 2; }
layer_of() { # FILE -> its layer, or nothing
    printf '%s\n' "$table" | while read -r p name; do
        case $1 in "$p"/* | "$p".*) echo "$name"; break ;; esac
    done
}
allowed() { printf '%s\n' "$uses" | sed -n "s/^$1: //p"; }
files=$(printf '%s\n' "$table" | while read -r p name; do
    if [ -d "$p" ]; then find "$p" -type f \( -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cc' \); else ls "$p".* 2>/dev/null; fi
done | sort -u)
for f in $files; do
    from=$(layer_of "$f")
    [ -n "$from" ] || continue
    ok="$from $(allowed "$from")"
    grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[a-z_]*/[A-Za-z0-9_/]*\.h"' "$f" | while IFS= read -r line; do
        inc=$(printf '%s\n' "$line" | sed 's/.*"\(.*\)".*/\1/')
        to=$(layer_of "$inc")
        [ -n "$to" ] || to="outside any layer"
        case " $ok " in
        *" $to "*) ;;
        *) echo "$f:${line%%:*}: the $from layer may not include $inc (the $to layer); see Makefile.am's layer table"; echo x ;;
        esac
    done
done | { out=$(cat); [ -z "$out" ] && exit 0; printf '%s\n' "$out" | grep -v '^x$' >&2; exit 1; }
