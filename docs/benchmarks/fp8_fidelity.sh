#!/usr/bin/env bash
# FP8 fidelity at 5,000 steps, speedkit's recipes beside torchao's, on every GPU of one host at
# once: examples/fp8_fidelity.rs (packed) and its PyTorch twin docs/benchmarks/fp8_fidelity.py,
# each job on a GPU of its own as GPUs come free, longest jobs first. Run from the project root on
# the CUDA host, after the executables were packed (fp8_fidelity; see README, "Benchmarks"), with
# torchao importable (a wheel in WHEELDIR is installed first when given):
#
#   bash docs/benchmarks/fp8_fidelity.sh PACKDIR OUTDIR [STEPS] [WHEELDIR] [JOBS]
#   e.g.  bash docs/benchmarks/fp8_fidelity.sh .gpu "$OUT" 5000 .whl
#
# JOBS (all by default): a comma-separated subset of the job names below. Every job writes
# OUTDIR/<job>.log and OUTDIR/<job>.jsonl (one summary line per run: the converged loss and its
# ratio to bf16's, bf16 trained in the same process); fp8_fidelity.jsonl gathers them. Each job is
# bounded by a timeout, so that one hang cannot take the session's device time.
set -uo pipefail
pack=${1:?usage: fp8_fidelity.sh PACKDIR OUTDIR [STEPS] [WHEELDIR] [JOBS]}
out=${2:?usage: fp8_fidelity.sh PACKDIR OUTDIR [STEPS] [WHEELDIR] [JOBS]}
steps=${3:-5000}
wheels=${4:-}
only=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
if [ -n "$wheels" ]; then
  python3 -m pip install --quiet --no-deps --no-index "$wheels"/torchao-*.whl >"$out/pip.log" 2>&1 ||
    echo "torchao not installed: see $out/pip.log"
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv >"$out/environment.txt" 2>&1
python3 -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__)' \
  >>"$out/environment.txt" 2>&1
cat "$out/environment.txt"

sk="bash $pack/run fp8_fidelity --task learn --steps $steps"
py="python3 $here/fp8_fidelity.py --steps $steps"
# name|command, longest first; each command gets --json OUTDIR/<name>.jsonl.
jobs=(
  "torchao_mlp_block|$py --workloads mlp_block --variants bf16,tensorwise,rowwise"
  "speedkit_mlp_block_delayed|$sk --workloads mlp_block --fp8 delayed,delayed:e4m3,dynamic"
  "speedkit_mlp_block_rowwise|$sk --workloads mlp_block --fp8 rowwise,rowwise:e5m2"
  "torchao_transformer|$py --workloads transformer --variants bf16,tensorwise,rowwise"
  "speedkit_transformer|$sk --workloads transformer --fp8 delayed,dynamic,rowwise"
  "speedkit_linear3|$sk --workloads linear3 --fp8 delayed,delayed:e4m3,dynamic,dynamic:e4m3,rowwise,rowwise:e5m2"
  "torchao_linear3|$py --workloads linear3 --variants bf16,tensorwise,rowwise"
)

export PYTHONUNBUFFERED=1 PACK_OUT="$out" JOB_TIMEOUT="${JOB_TIMEOUT:-570}" ONLY="$only"
printf '%s\n' "${jobs[@]}" | python3 -c '
import os, queue, subprocess, sys, threading, time
out, limit, only = os.environ["PACK_OUT"], os.environ["JOB_TIMEOUT"], os.environ["ONLY"]
jobs = [line.rstrip("\n").split("|", 1) for line in sys.stdin if line.strip()]
jobs = [j for j in jobs if not only or j[0] in only.split(",")]
gpus = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout.split()
work = queue.Queue()
for job in jobs:
    work.put(job)
def worker(gpu):
    while True:
        try:
            name, command = work.get_nowait()
        except queue.Empty:
            return
        started = time.time()
        with open(f"{out}/{name}.log", "w") as log:
            status = subprocess.call(
                ["timeout", "--kill-after=10", limit, "bash", "-c",
                 f"{command} --json {out}/{name}.jsonl"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
        print(f"== {name} on GPU {gpu}: exit {status} in {time.time() - started:.0f} s", flush=True)
threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
for t in threads:
    t.start()
for t in threads:
    t.join()
'
cat "$out"/*.jsonl >"$out/fp8_fidelity.jsonl" 2>/dev/null
grep -h "converged" "$out"/*.log
