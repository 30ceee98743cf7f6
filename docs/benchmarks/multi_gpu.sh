#!/usr/bin/env bash
# Data parallel on N GPUs of one host (2 unless --nproc-per-node says otherwise), in one device
# session: speedkit's runner on `transformer` and `linear3` with 1 GPU and with N under `speedkit
# launch` (each all-reduce path), PyTorch DDP and FSDP2 (pytorch_reference.py --ddp and --fsdp under
# torchrun, eager AMP and torch.compile) with 1 and N processes, and the NCCL equality test (one rank per GPU of the host). Run from the
# project root on the CUDA host, after the executables were packed (bench, speedkit,
# toy_transformer and the distributed test; see README, "Benchmarks"):
#
#   bash docs/benchmarks/multi_gpu.sh [--nproc-per-node N] PACKDIR OUTDIR [PART...]
#   e.g.  bash docs/benchmarks/multi_gpu.sh --nproc-per-node 4 .gpu "$OUT"
#
# PARTs (all by default): speedkit ddp ddp_compile fsdp fsdp_compile equality fault toy — two device commands can share
# the parts where one would not fit in 600 s.
#
# Everything lands in OUTDIR: one log per part, the runners' and the reference's JSON, and
# multi_gpu_summary.md (tokens/s per configuration and the scaling from 1 to N GPUs). Each part is
# bounded by a timeout, so that one hang cannot take the session's device time.
set -uo pipefail
usage="usage: multi_gpu.sh [--nproc-per-node N] PACKDIR OUTDIR [PART...]"
gpus=2
if [ "${1:-}" = --nproc-per-node ]; then
  gpus=${2:?$usage}
  shift 2
fi
[[ $gpus =~ ^[1-9][0-9]*$ ]] || { echo "--nproc-per-node takes a number of GPUs, not '$gpus'" >&2; exit 2; }
pack=${1:?$usage}
out=${2:?$usage}
shift 2
parts=" ${*:-speedkit ddp ddp_compile fsdp fsdp_compile equality fault toy} "
wanted() { [[ $parts == *" $1 "* ]]; }
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
sk=(bash "$pack/run")
part() { # part NAME SECONDS COMMAND...: runs COMMAND into OUTDIR/NAME.log, says how it ended
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$out/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status" | tee -a "$out/$name.log"
}

{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

# Per-GPU batch unchanged from 1 to N GPUs (the workloads' bench size on every rank). `auto` is
# one CUDA graph per step, on N GPUs with speedkit's all-reduce inside it, started during the
# backward pass; auto_eager is the eager step (on N GPUs, c10d's Reducer); dp_after_backward
# all-reduces after the backward pass, dp_bf16 sends bf16 gradients, dp_sharded shards the
# optimizer state (ZeRO-1), dp_zero3 the parameters too (ZeRO-3, eager). Every N-GPU row is compared with its own config on 1 GPU, or with
# `auto` where the config only matters on several.
configs=(--config auto --config examples/configs/auto_eager.yaml)
dp_configs=(--config examples/configs/dp_after_backward.yaml --config examples/configs/dp_bf16.yaml
  --config examples/configs/dp_sharded.yaml --config examples/configs/dp_zero3.yaml)
work=(--exact --filter transformer --filter linear3 --size bench)
if wanted speedkit; then
  part speedkit_1gpu 90 "${sk[@]}" bench "${work[@]}" "${configs[@]}" --json "$out/speedkit_1gpu.json"
  part "speedkit_${gpus}gpu" 200 "${sk[@]}" speedkit launch --nproc-per-node "$gpus" -- \
    bash "$pack/run" bench "${work[@]}" "${configs[@]}" "${dp_configs[@]}" --json "$out/speedkit_${gpus}gpu.json"
fi

export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
ref=(python3 -m torch.distributed.run --standalone)
for n in 1 "$gpus"; do
  wanted ddp && part "pytorch_ddp_${n}gpu" 80 "${ref[@]}" --nproc-per-node "$n" \
    "$here/pytorch_reference.py" --ddp --only transformer,linear3 --json "$out/pytorch_ddp_${n}gpu.json"
  wanted ddp_compile && part "pytorch_ddp_compile_${n}gpu" 200 "${ref[@]}" --nproc-per-node "$n" \
    "$here/pytorch_reference.py" --ddp --compile --only transformer,linear3 \
    --json "$out/pytorch_ddp_compile_${n}gpu.json"
  wanted fsdp && part "pytorch_fsdp2_${n}gpu" 80 "${ref[@]}" --nproc-per-node "$n" \
    "$here/pytorch_reference.py" --fsdp --only transformer,linear3 --json "$out/pytorch_fsdp2_${n}gpu.json"
  wanted fsdp_compile && part "pytorch_fsdp2_compile_${n}gpu" 200 "${ref[@]}" --nproc-per-node "$n" \
    "$here/pytorch_reference.py" --fsdp --compile --only transformer,linear3 \
    --json "$out/pytorch_fsdp2_compile_${n}gpu.json"
done

# test_part NAME SECONDS TEST: one test of the distributed executable; a test name that matches
# nothing passes with "0 passed", so say so.
test_part() {
  local name=$1 limit=$2 test=$3
  part "$name" "$limit" "${sk[@]}" distributed.test --exact "$test" --nocapture --test-threads=1
  grep -q "test result: ok. 1 passed" "$out/$name.log" ||
    echo "== $name: the test did not run and pass" | tee -a "$out/$name.log"
}
wanted equality && test_part nccl_equality 200 \
  training::nccl_ranks_match_one_process_eager_on_the_reducer_and_graphed_on_speedkits_all_reduce
# The fault row: rank 1 killed (SIGKILL) while the step's graph is replayed; rank 0 must exit with
# status 1 within the 10 s timeout, naming rank 1 by its heartbeat.
wanted fault && test_part fault 150 \
  faults::a_rank_killed_while_the_step_is_replayed_is_named_by_the_other_which_exits
wanted toy && part "toy_transformer_${gpus}gpu" 50 "${sk[@]}" speedkit launch --nproc-per-node "$gpus" -- \
  bash "$pack/run" toy_transformer --size bench --steps 100

python3 - "$out" "$gpus" <<'PY' | tee "$out/multi_gpu_summary.md"
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError) as e:
        print(f"(no {name}: {e})")
        return None
def speedkit_rates(report):
    rates = {}
    for r in (report or {}).get("rows", []):
        m = r.get("measurement")
        if not m or not m.get("items_per_step"):
            continue
        items, unit = m["items_per_step"]
        dp = r.get("data_parallel") or {}
        t = dp.get("throughput")
        total = t["total"] if t else items / (m["median_ms"] * 1e-3)
        mem = m.get("memory") or {}
        gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "?"
        memory = (gib(mem.get("peak_allocated_bytes")),
                  gib((mem.get("breakdown") or {}).get("optimizer_state")))
        comm = [(dp.get(k) or [None])[0] for k in ("collectives_ms_per_rank", "exposed_ms_per_rank")]
        comm = f"{comm[0]:.3f} / {comm[1]:.3f}" if None not in comm else ""
        rates[(r["workload"], r["config"])] = (total, unit, m["median_ms"], memory, comm)
    return rates
one, two = speedkit_rates(load("speedkit_1gpu.json")), speedkit_rates(load(f"speedkit_{n}gpu.json"))
print(f"| workload | config | 1 GPU | {n} GPUs, total | scaling | ms/step 1 → {n} | "
      f"peak alloc GiB per GPU 1 → {n} | optimizer state GiB per GPU 1 → {n} | "
      f"collectives / exposed ms per step, rank 0 of {n} |")
print("|---|---|---|---|---|---|---|---|---|")
for key in sorted(set(one) | set(two)):
    # A config that only matters on several GPUs is compared with `auto` on one.
    r1 = one.get(key) or one.get((key[0], "auto"))
    r2 = two.get(key)
    if r1 is None or r2 is None:
        print(f"| {key[0]} | speedkit {key[1]} | (missing: 1 GPU {r1 is not None}, {n} GPUs "
              f"{r2 is not None}) | | | | | | |")
        continue
    print(f"| {key[0]} | speedkit {key[1]} | {r1[0]:.0f} {r1[1]}/s | {r2[0]:.0f} {r2[1]}/s | "
          f"{r2[0] / r1[0]:.3f}x | {r1[2]:.3f} → {r2[2]:.3f} | {r1[3][0]} → {r2[3][0]} | "
          f"{r1[3][1]} → {r2[3][1]} | {r2[4]} |")
def peer_memory(row):
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "?"
    return (gib((row.get("memory") or {}).get("peak_allocated_bytes")),
            gib(row.get("optimizer_state_bytes")))
for label, stem in (("PyTorch DDP AMP", "pytorch_ddp"), ("PyTorch DDP + torch.compile", "pytorch_ddp_compile"),
                    ("PyTorch FSDP2 AMP", "pytorch_fsdp2"),
                    ("PyTorch FSDP2 + torch.compile", "pytorch_fsdp2_compile")):
    ddp = {k: load(f"{stem}_{k}gpu.json") for k in (1, n)}
    rows = {k: {r["workload"]: r for r in (d or {}).get("results", []) if "throughput" in r}
            for k, d in ddp.items()}
    for name in sorted(rows[1]):
        a, b = rows[1][name], rows[n].get(name)
        t1 = a["throughput"]
        if b is None:
            print(f"| {name} | {label} | {t1['total']:.0f} {t1['unit']}/s | - | - | - | | | |")
            continue
        t2 = b["throughput"]
        m1, m2 = peer_memory(a), peer_memory(b)
        print(f"| {name} | {label} | {t1['total']:.0f} {t1['unit']}/s | {t2['total']:.0f} "
              f"{t2['unit']}/s | {t2['total'] / t1['total']:.3f}x | {a['median_ms']:.3f} → "
              f"{b['median_ms']:.3f} | {m1[0]} → {m2[0]} | {m1[1]} → {m2[1]} | |")
PY
grep -h "== .*: exit" "$out"/*.log
