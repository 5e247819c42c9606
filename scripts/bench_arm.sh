#!/usr/bin/env bash
# One command for an ARM (aarch64) host: which kernels load there, the kernel benchmarks
# (fp32, bf16-weight and weight-only int8 few-row GEMMs and MoE calls against torch's GEMM)
# and the offline benchmark on the benchmark model (fp32, int8 and bf16, moeserve against
# transformers),
# everything into one folder to send back with the host's description.
#
#     scripts/bench_arm.sh [--threads N] [--out DIR] [--quick]
#
# --threads: intra-op threads (default: all cores of the first NUMA node); --out: where the
# tables and JSON go (default: bench_out/arm-<host>-<date>); --quick: fewer cases (~10 min
# instead of ~40 on a 32-core node). Nothing here was run on an ARM host by the project: see
# docs/benchmarks.md, "ARM hosts".
set -euo pipefail
cd "$(dirname "$0")/.."

threads="" out="" quick=0
while [ $# -gt 0 ]; do
    case "$1" in
        --threads) threads="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        *) echo "usage: $0 [--threads N] [--out DIR] [--quick]" >&2; exit 2 ;;
    esac
done
case "$(uname -m)" in
    aarch64 | arm64) ;;
    *) echo "bench_arm: this is $(uname -m), not an ARM host (the x86 benchmarks: docs/benchmarks.md)" >&2
       exit 2 ;;
esac
if [ -z "$threads" ]; then
    threads=$(lscpu -p=CPU,NODE 2>/dev/null | grep -v '^#' | awk -F, '$2 == 0' | wc -l)
    [ "$threads" -gt 0 ] || threads=$(nproc)
fi
out=${out:-bench_out/arm-$(hostname -s)-$(date +%Y%m%d-%H%M)}
mkdir -p "$out"
[ -x .venv/bin/python ] || make setup
PY=.venv/bin/python

{
    echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "threads: $threads"
    uname -a
    lscpu
    echo "sve_default_vector_length (bytes): $(cat /proc/sys/abi/sve_default_vector_length 2>/dev/null || echo none)"
    grep -m1 -i features /proc/cpuinfo || true
} > "$out/host.txt"

# which sources built here and what the GEMMs run as (NEON, SVE-<bits>); the others fall
# back to torch (a warning says so)
$PY - <<'EOF' | tee "$out/kernels.txt"
from moeserve.ops.cpu import build, fp32, int8
from moeserve.platform import cpu_flags, sve_vector_bits
import platform
machine = platform.machine()
print("flags:", " ".join(build.compile_flags(machine, cpu_flags(), sve_vector_bits()) or ["none"]))
print("fp32 kernels:", fp32.available(), "int8 kernels:", int8.available(),
      "as", fp32.isa_name(False))
EOF

run() { # name, command...: the command's table to the terminal and to $out/<name>.txt
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.txt"
}

if [ "$quick" = 1 ]; then
    rows="1 4 16 64" batches=1,8 prefill=512
else
    rows="1 2 4 8 16 32 48 64 96 128" batches=1,8,32,64 prefill=512,2048
fi
run fp32_gemm $PY benchmarks/fp32_gemm.py --threads "$threads" --rows $rows --out "$out/fp32_gemm.json"
run bf16_gemm $PY benchmarks/fp32_gemm.py --threads "$threads" --rows $rows --weights bf16 \
    --out "$out/bf16_gemm.json"
run int8_gemm $PY benchmarks/int8_gemm.py --threads "$threads"
run offline_throughput $PY benchmarks/offline_throughput.py --threads "$threads" \
    --formats fp32,int8,bf16 --batches "$batches" --prefill "$prefill" \
    --out "$out/offline_throughput.json" --plot "$out/offline_throughput.png"
echo "bench_arm: results in $out (host.txt describes the machine)"
