#!/usr/bin/env bash
# Run a command as on an AVX2-only CPU, on any x86-64 Linux machine: under qemu-user emulating an AMD EPYC Zen 3
# (`-cpu EPYC-Milan`: AVX2, FMA, F16C, no AVX-512; any AVX-512 instruction dies of SIGILL as on such a CPU), with
# /proc/cpuinfo's flags stripped of avx512*, amx* and the AVX-VNNI ones in a private mount namespace, so that cag
# (which reads the flags there) and torch (which asks CPUID) both see the emulated CPU.
#
#   bench/avx2_cpu.sh .venv/bin/python -m bench.bench_exactness --configs auto/auto --seed-list 9322,9361 --no-cost \
#       --name exactness-avx2-cpu
#   bench/avx2_cpu.sh .venv/bin/python -m pytest -q tests/test_avx2_products.py
#
# The command's own process is emulated; programs it starts (a test's subprocess) run on the real CPU and see only
# the stripped flags. For correctness only: emulation runs ~20-50x slower than the CPU, so its timings mean nothing.
# Needs qemu-user (Debian: apt-get install qemu-user) and unshare with a mount namespace (root, or unprivileged user
# namespaces).
# CAG_EMULATED_CPU picks another qemu CPU model (`qemu-x86_64 -cpu help`), e.g. Haswell. Libraries built under it
# are keyed by the stripped flags, apart from the machine's own (cag.kernels.native.build_key).
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bench/avx2_cpu.sh COMMAND [ARGS...]" >&2; exit 2; }
command -v qemu-x86_64 >/dev/null || { echo "error: qemu-x86_64 not found (apt-get install qemu-user)" >&2; exit 2; }
prog=$(type -P "$1") || { echo "error: $1 is not a program (qemu runs files, not shell builtins)" >&2; exit 2; }
cpu=${CAG_EMULATED_CPU:-EPYC-Milan}
flags=$(mktemp "${TMPDIR:-/tmp}/cpuinfo-avx2.XXXXXX")
trap 'rm -f "$flags"' EXIT
# the model name says so, for what results files name as their machine (bench/common.py: machine)
sed -E -e '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ne_convert)\b//g' \
    -e "/^model name/ s/\$/ under qemu-user -cpu $cpu/" /proc/cpuinfo > "$flags"
as_root=(-m)
[ "$(id -u)" -eq 0 ] || as_root=(-r -m)
# qemu names every host feature TCG cannot give the guest once per process: not errors, left out
inside='f=$0 cpu=$1; shift; mount --bind "$f" /proc/cpuinfo && exec qemu-x86_64 -cpu "$cpu" "$@"'
unshare "${as_root[@]}" sh -c "$inside" \
    "$flags" "$cpu" "$prog" "${@:2}" 2> >(grep -v "TCG doesn't support requested feature" >&2)
