#!/usr/bin/env bash
# Diagnosis only: run a benchmark with MKL's Intel code paths forced on a non-Intel x86 CPU.
#
# torch's x86 wheels call MKL for float32 GEMMs, and MKL picks its AVX2/AVX-512 kernels only on CPUs whose
# vendor is Intel; elsewhere (AMD) it runs generic code. This preloads a one-line library that answers MKL's
# vendor check with "Intel" (a known community workaround), so a run shows what the same hardware does with
# MKL's fast kernels. attnslim never does this by itself, and nothing in the library depends on it: it exists
# so that BENCHMARKS can say why speed results differ between hosts. Results record the preload
# (environment.ld_preload).
#
#     benchmarks/with_mkl_intel_paths.sh benchmarks/mla_kernels.py --name mla-kernels-mkl-intel
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 benchmarks/SCRIPT.py [args...]" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf 'int mkl_serv_intel_cpu_true(void) { return 1; }\n' > "$dir/vendor.c"
cc -shared -fPIC -o "$dir/libmkl_vendor.so" "$dir/vendor.c"
root=$(cd "$(dirname "$0")/.." && pwd)
LD_PRELOAD="$dir/libmkl_vendor.so" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$root/.venv/bin/python" "$@"
