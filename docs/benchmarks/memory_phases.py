"""Where a training step's device memory goes, phase by phase, in PyTorch's whole-step CUDA graph
(torch.cuda.graph, warm-up on a side stream): the twin of `examples/memory_phases.rs`, with the same
model (pytorch_reference.py's), batch, AMP bf16 and fused capturable AdamW, and the same columns.

    python3 docs/benchmarks/memory_phases.py [transformer|mlp_block] [--eager] [--steps N]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_reference as ref  # noqa: E402


def pools():
    default = graph = frag = 0
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        if tuple(pool) == (0, 0):
            default += segment["total_size"]
        else:
            graph += segment["total_size"]
        frag += sum(b["size"] for b in segment["blocks"] if b["state"] == "inactive"
                    and len(segment["blocks"]) > 1)
    return default, graph, frag


def row(moment):
    torch.cuda.synchronize()
    gib = lambda b: f"{b / 2**30:.3f}"
    default, graph, frag = pools()
    print(f"{moment:<44} {gib(torch.cuda.memory_allocated()):>9} {gib(torch.cuda.memory_reserved()):>9} "
          f"{gib(torch.cuda.max_memory_allocated()):>9} {gib(torch.cuda.max_memory_reserved()):>9} "
          f"{gib(default):>9} {gib(graph):>9} {gib(frag):>9} {'-':>9}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="transformer")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"{'moment':<44} {'alloc':>9} {'reserved':>9} {'peak al':>9} {'peak res':>9} {'default':>9} "
          f"{'graph':>9} {'frag':>9} {'copies':>9}")
    device = torch.device("cuda")
    row("start")
    model, batch, _, _ = ref.workload(args.model, device)
    row(f"{args.model} built")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True,
                            capturable=not args.eager)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()

    if args.eager:
        for i in range(args.steps):
            step()
            row(f"step {i + 1} (eager)")
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            step()
            row(f"step {i + 1} (graph warm-up)")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    row("step 4 (capture + first replay)")
    for i in range(4, args.steps):
        graph.replay()
        row(f"step {i + 1} (replay)")
    del graph, opt, model, batch
    row("model, optimizer and graph dropped")
    torch.cuda.empty_cache()
    row("empty_cache")


if __name__ == "__main__":
    main()
