"""The reference workloads of docs/workloads.md in PyTorch, timed with speedkit's protocol.

speedkit's figures mean something only next to the same work done the usual way, on the same
machine, in the same session. This script trains `transformer`, `linear3` and `mlp` exactly as
docs/workloads.md defines them, in PyTorch eager with AMP bf16 and fused AdamW; with --compile also
under torch.compile's default and `reduce-overhead` modes; with --graph also as one whole-step
CUDA graph of the eager kernels (forward, backward and optimizer captured with
torch.cuda.graph: what speedkit's graph mode does, so the two show the same kernels' cost). It
times each step between CUDA events with a device synchronisation after every step (10 warm-up +
50 timed steps, median/p10/p90).

    python3 docs/benchmarks/pytorch_reference.py [--compile] [--graph] [--profile] [--json FILE]

--profile prints torch.profiler's kernel table for one eager `transformer` step and times the
attention of that workload under each SDPA backend, which is where to look for a step's time.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (p.view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, vocab=8192, d=768, heads=12, layers=6, seq=512):
        super().__init__()
        self.tok = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, targets):
        x = F.embedding(tokens, self.tok) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class Linear3(nn.Module):
    def __init__(self, width=8192):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))

    def forward(self, x, target):
        return F.mse_loss(self.layers(x), target)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x, labels):
        return F.cross_entropy(self.layers(x), labels)


def workload(name, device):
    torch.manual_seed(0)
    if name == "transformer":
        model = Transformer()
        batch = (torch.randint(0, 8192, (32, 512), device=device),
                 torch.randint(0, 8192, (32, 512), device=device))
        flops = 6 * 32 * 512 * (6 * 7_077_888 + 6_291_456) + 3 * 6 * 2 * 32 * 512**2 * 768
    elif name == "linear3":
        model = Linear3()
        batch = (torch.randn(512, 8192, device=device), torch.randn(512, 8192, device=device))
        flops = 3 * 3 * 2 * 512 * 8192**2
    else:
        model = Mlp()
        batch = (torch.randn(256, 512, device=device), torch.randint(0, 10, (256,), device=device))
        flops = 0.82e9
    return model.to(device), batch, flops


def time_steps(step, warmup=10, steps=50):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[0], q[-1]


def train_step(model, batch, mode):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True,
                            capturable=mode == "graph")
    compiled = mode not in ("eager", "graph")
    forward = torch.compile(model, mode=mode) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(*batch)
        loss.backward()
        opt.step()

    if mode != "graph":
        return step
    # PyTorch's whole-network capture recipe: warm up on a side stream, capture one step, replay.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def profile_transformer(device):
    model, batch, _ = workload("transformer", device)
    step = train_step(model, batch, "eager")
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))

    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(32, 12, 512, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel(backend):
            def attention():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            try:
                median, _, _ = time_steps(attention)
                print(f"attention fwd+bwd, one layer, {backend.name}: {median:.3f} ms")
            except RuntimeError as e:
                print(f"attention {backend.name}: {e}".splitlines()[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    if args.profile:
        profile_transformer(device)
    results = []
    modes = (["eager"] + (["graph"] if args.graph else [])
             + (["default", "reduce-overhead"] if args.compile else []))
    for name in ("transformer", "linear3", "mlp"):
        for mode in modes:
            model, batch, flops = workload(name, device)
            median, p10, p90 = time_steps(train_step(model, batch, mode))
            row = dict(workload=name, mode=mode, median_ms=median, p10_ms=p10, p90_ms=p90,
                       tflops=flops / median / 1e9)
            results.append(row)
            print(f"{name:12} {mode:16} {median:8.3f} ms  p10 {p10:.3f}  p90 {p90:.3f}  "
                  f"{row['tflops']:.1f} TFLOP/s", flush=True)
            del model, batch
            torch.cuda.empty_cache()
    if args.json:
        env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                   cudnn=torch.backends.cudnn.version(), python=sys.version.split()[0])
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, protocol="10 warm-up + 50 timed steps, CUDA events, "
                           "synchronised after every step", results=results), f, indent=2)


if __name__ == "__main__":
    main()
