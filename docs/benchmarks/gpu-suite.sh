#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks/: run from the project root on the CUDA host, after
# `../shared/gpu/pack` packed the executables into .gpu/ (see README, "Benchmarks").
#   bash docs/benchmarks/gpu-suite.sh tests|suite|examples|reference|peer|all OUTDIR
# `reference` times the same workloads in PyTorch (pytorch_reference.py) with the host's python3;
# `peer` runs the training workloads and that reference in one runner invocation (--peer pytorch).
set -uo pipefail
part=${1:?tests|suite|examples}
out=${2:?output directory}
run() { echo "+ $*"; bash .gpu/run "$@"; echo "exit $?"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
if [ "$part" = all ]; then
  for p in tests suite examples reference; do bash "$0" $p "$out"; done
  exit
fi
case $part in
tests)
  for t in flags amp optim context training gpu macro_accelerate workloads bench_runner; do
    # --nocapture: the fidelity tests print the gaps they measured.
    run $t.test --test-threads=1 --nocapture 2>&1 | grep -Ev '^test .* \.\.\. ok$'
  done
  run speedkit report --apply --restore
  ;;
suite)
  run bench --exact --filter linear3 --filter mlp --filter transformer --filter resnet \
    --config fp32_strict --config tf32 --config examples/configs/auto_eager.yaml --config auto \
    --json "$out/training.json" --csv "$out/training.csv" --svg "$out/training.svg"
  run bench --filter matmul4 --filter matmul8192 --config fp32_strict --config tf32 --config fp16 \
    --config bf16 --json "$out/matmul.json"
  run bench --filter anatomy --config fp32_strict --config auto --json "$out/anatomy.json"
  ;;
examples)
  run ladder --size bench --json "$out/ladder.json"
  run benchmark_compare --size bench
  run macro_overhead --size bench
  run toy_transformer --size bench --steps 200
  run train_cifar_resnet --size bench
  ;;
reference)
  PYTHONUNBUFFERED=1 python3 docs/benchmarks/pytorch_reference.py --graph --compile \
    --json "$out/pytorch-reference.json"
  ;;
peer)
  run bench --exact --filter transformer --filter linear3 --filter mlp --filter resnet \
    --config examples/configs/auto_eager.yaml --config auto --peer pytorch \
    --json "$out/peer.json"
  ;;
esac
