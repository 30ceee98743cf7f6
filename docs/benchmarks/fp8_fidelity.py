"""The PyTorch twin of examples/fp8_fidelity.rs: the same models on the same `learn` tasks, trained in
bf16 and with torchao's FP8 training (`Float8Linear` on every nn.Linear), so that a converged loss
that FP8 loses can be told apart: speedkit's FP8 path, or FP8 itself.

Tasks (as the Rust example's `--task learn`): `linear3` and `mlp_block` fit a random linear teacher
(`target = x A + 0.1 ε`, a fresh batch every step, loss floor 0.01); `transformer` predicts the
next token of a random Markov chain in which each token has 4 successors (floor about ln 4 nats).
Every run starts from the same initialisation (seed 0) and sees the same batches. Each step runs
under torch.compile's default mode with bf16 autocast and fused AdamW (lr 1e-4, weight decay 0.01,
speedkit's `AdamW` defaults), as torchao's own FP8 training recipe runs.

Variants (`--variants`): `bf16`; `tensorwise` (torchao's dynamic per-tensor scales, e4m3 forward,
e5m2 gradients); `rowwise` (per-row scales, e4m3 everywhere).

    python3 docs/benchmarks/fp8_fidelity.py --steps 5000 --workloads linear3,mlp_block \
        --variants bf16,tensorwise,rowwise --json fidelity.jsonl

Needs a GPU with FP8 Tensor Cores and torchao (not in requirements-torch.txt: install it beside
torch). Exit status 3: no CUDA device; 4: torch or torchao cannot be imported.
"""

import argparse
import json
import math
import os
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as error:
    print(f"cannot import torch: {error}", file=sys.stderr)
    sys.exit(4)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import Linear3, MlpBlock, Transformer  # noqa: E402

SOURCE_SEED = 1000
SUCCESSORS = 4


def regression_source(batch, width):
    torch.manual_seed(SOURCE_SEED)
    a = torch.randn(width, width, device="cuda") / math.sqrt(width)

    def batch_of(index):
        torch.manual_seed(SOURCE_SEED + 1 + index)
        x = torch.randn(batch, width, device="cuda")
        noise = torch.randn(batch, width, device="cuda") * 0.1
        return x, x @ a + noise

    return batch_of


def markov_source(steps, batch, seq_len, vocab):
    torch.manual_seed(SOURCE_SEED)
    successors = torch.randint(vocab, (vocab, SUCCESSORS), device="cuda")
    rows = steps * batch
    choices = torch.randint(SUCCESSORS, (rows, seq_len, 1), device="cuda")
    current = torch.randint(vocab, (rows,), device="cuda")
    sequence = [current]
    for position in range(seq_len):
        current = successors.index_select(0, current).gather(1, choices[:, position]).squeeze(1)
        sequence.append(current)
    sequences = torch.stack(sequence, 1)

    def batch_of(index):
        part = sequences[index * batch:(index + 1) * batch]
        return part[:, :-1].contiguous(), part[:, 1:].contiguous()

    return batch_of


def workload(name, steps):
    """(model, batch source) of a workload at its bench size."""
    if name == "linear3":
        return Linear3(8192), regression_source(512, 8192)
    if name == "mlp_block":
        return MlpBlock(4096, 16384), regression_source(16384, 4096)
    if name == "transformer":
        return Transformer(), markov_source(steps, 32, 512, 8192)
    raise SystemExit(f"unknown workload {name!r}: linear3, mlp_block or transformer")


def train(name, variant, steps):
    torch.manual_seed(0)
    model, batch_of = workload(name, steps)
    model = model.cuda()
    if variant != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(variant))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    compiled = torch.compile(model)
    losses = []
    for index in range(steps):
        x, target = batch_of(index)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--workloads", default="linear3,mlp_block,transformer")
    parser.add_argument("--variants", default="bf16,tensorwise,rowwise")
    parser.add_argument("--json", help="also write one JSON line per run here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_fidelity.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(3)
    try:
        import torchao  # noqa: F401
    except ImportError as error:
        print(f"cannot import torchao: {error}; pip install torchao", file=sys.stderr)
        sys.exit(4)
    # TF32 for fp32 matmuls (the teacher's targets), as speedkit's plan sets it for bf16 training.
    torch.set_float32_matmul_precision("high")
    variants = args.variants.split(",")
    if variants[0] != "bf16":
        raise SystemExit("--variants must start with bf16, the reference of the ratios")
    out = open(args.json, "w") if args.json else None
    tail = max(10, args.steps // 100)
    for name in args.workloads.split(","):
        started = time.time()
        print(f"{name}, task learn, {args.steps} steps, lr 0.0001, torch {torch.__version__}, torchao "
              f"{getattr(sys.modules['torchao'], '__version__', '?')}", flush=True)
        runs = []
        for variant in variants:
            losses = train(name, variant, args.steps)
            runs.append((variant, losses))
            # Reported as soon as trained: a long run cut short keeps what it finished.
            bf16_converged = sum(runs[0][1][-tail:]) / tail
            converged = sum(losses[-tail:]) / tail
            ratio = converged / bf16_converged
            verdict = "within" if abs(ratio - 1) <= 0.01 else "NOT within"
            print(f"  torchao {variant:<11} final {losses[-1]:<10.6f} converged (last {tail}) "
                  f"{converged:<10.6f} / bf16 {ratio:.4f}  ({verdict} 1%)", flush=True)
            if out:
                out.write(json.dumps({
                    "workload": name, "task": "learn", "steps": args.steps,
                    "variant": f"torchao {variant}", "final_loss": losses[-1],
                    "converged_loss": converged, "converged_over_steps": tail,
                    "ratio_to_bf16": ratio, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(),
                }) + "\n")
                out.flush()
        every = max(1, args.steps // 8)
        print("  step    " + "".join(f"{v:<15}" for v, _ in runs))
        for step in range(1, args.steps + 1):
            if step == 1 or step % every == 0 or step == args.steps:
                print(f"  {step:<6}  " + "".join(f"{losses[step - 1]:<15.6f}" for _, losses in runs))
        print(f"  ({time.time() - started:.0f} s)", flush=True)

if __name__ == "__main__":
    main()
