"""PyTorch's kernels for one reference workload of pytorch_reference.py, a step's worth: the CUDA
time of each kernel name over three profiled steps (after eight unprofiled), divided by three, and
the totals by kind (GEMM and attention, Triton, AdamW, other), to set beside the runner's
`bench --profile` table of speedkit's step.

    python3 docs/benchmarks/peer_kernels.py transformer_tch reduce-overhead   # or default, eager

Needs PyTorch with CUDA (and Triton for the compiled modes). Under reduce-overhead the kernels of
the captured graphs are listed as they replay; the step's own time (launches and gaps included) is
`bench --peer pytorch`'s.
"""
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_reference as ref  # noqa: E402

STEPS = 3


def kind(name):
    lower = name.lower()
    if any(s in lower for s in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "flash", "fmha", "attention")):
        return "gemm+attention"
    if lower.startswith("triton"):
        return "triton"
    if "adam" in lower or "multi_tensor" in lower:
        return "adamw"
    return "other"


def main():
    name = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "default"
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    model, batch, _, _ = ref.workload(name, device)
    step, _ = ref.train_step(model, batch, mode)
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time
    totals = collections.defaultdict(float)
    for kernel, (_, us) in kernels.items():
        totals[kind(kernel)] += us / STEPS
    print(f"== {name} {mode}: kernel time a step, us")
    for k, us in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {k:15} {us:10.1f}")
    print(f"  {'total':15} {sum(totals.values()):10.1f}")
    for kernel, (calls, us) in sorted(kernels.items(), key=lambda item: -item[1][1])[:45]:
        print(f"{us / STEPS:9.1f} us {calls // STEPS:4d}x  [{kind(kernel)}] {kernel[:150]}")


if __name__ == "__main__":
    main()
