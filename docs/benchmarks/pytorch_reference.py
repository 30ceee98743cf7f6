"""The reference workloads of this repository (workloads/) in PyTorch, timed with speedkit's protocol.

speedkit's figures mean something only next to the same work done the usual way, on the same
machine, in the same session. This script trains `transformer`, `linear3`, `mlp`, `resnet` and
`mlp_block` exactly as the workloads define them, in PyTorch eager with AMP bf16 and fused AdamW; with
--compile also under torch.compile's default and `reduce-overhead` modes (the loss computed
inside the compiled model, as the strongest PyTorch user would write it); with --graph also as
one whole-step CUDA graph of the eager kernels (forward, backward and optimizer captured with
torch.cuda.graph: what speedkit's graph mode does, so the two show the same kernels' cost).
`resnet` runs channels-last. `transformer_tch` and `gpt2_tch` (speedkit's GPT written with tch's
own modules alone) and `gpt2` (the GPT on speedkit::nn at GPT-2 small's size) train this same
plain-PyTorch `Transformer`, the last two at GPT-2 small's size;
`llama_tch` (RMSNorm, rotary embeddings, SwiGLU), `unet_tch` (GroupNorm, SiLU, skip
concatenation) and `convnext_tch` (depthwise convolutions, channels LayerNorm, erf GELU, layer
scale) and `vit_tch` (patches, a class token, dropout) train their twins here, `Llama`, `Unet`,
`Convnext` and `Vit`, as a PyTorch user writes them. With --torchao-fp8 also torchao's FP8 training (`Float8Linear` on
every nn.Linear, tensorwise dynamic scaling, under torch.compile's default mode: the peer of
speedkit's `fp8` config; torchao is not in requirements-torch.txt, install it beside torch), and
with --torchao-fp8-rowwise the same with torchao's row-wise recipe (speedkit's `fp8.recipe:
rowwise`). Each step is timed between CUDA events with a device synchronisation after every step (10 warm-up + 50 timed steps unless --warmup/--steps say
otherwise; median/p10/p90 by nearest rank, as speedkit computes them).

Memory is measured as speedkit measures its own: the allocator's cache is emptied and its peaks
reset just before the optimizer is made and warm-up begins, so the peak allocated and peak
reserved cover the whole run (warm-up, compilation and graph capture included); the peak
allocated during the timed steps alone is reported apart as `steady_peak_allocated_bytes`.

    python3 docs/benchmarks/pytorch_reference.py [--compile] [--graph] [--only NAME,...]
        [--warmup N] [--steps N] [--no-paranoid-sync] [--json FILE] [--json-lines] [--profile]
        [--torchao-fp8] [--torchao-fp8-rowwise]

--json-lines prints one JSON object per line on stdout (the environment first, then one per
row as it finishes) and the human-readable lines on stderr: this is how the speedkit runner's
`--peer pytorch` reads it. Exit status 3: no CUDA device (the reference times CUDA work only);
4: torch cannot be imported; 5: a size other than `bench` was asked for.
--profile prints torch.profiler's kernel table for one eager `transformer` step and times the
attention of that workload under each SDPA backend, which is where to look for a step's time.

--ddp is the data-parallel peer of `speedkit launch`: run under torchrun, each rank trains its
replica wrapped in DistributedDataParallel (NCCL on its GPU, LOCAL_RANK; Gloo on the CPU where no
GPU is visible, which times by the host clock and reports no memory), AMP bf16 and fused AdamW as
above, on the same fixed batch on every rank (as speedkit's workloads under the launcher). Each
rank times its own steps; rank 0 gathers every rank's median and prints and writes the rows, each
with `world_size`, `median_ms_per_rank` and `throughput` (items/s per rank, `total` and `per_gpu`,
the fields of speedkit's report). With --compile the replica runs under torch.compile's default
mode (DDP's recommended pairing). --fsdp is the same under PyTorch's FSDP2 instead (`fully_shard`
on each block, then on the model: parameters, gradients and optimizer state sharded over the ranks,
ZeRO-3), parameters gathered in bf16 and gradients reduced in fp32, with --compile each block
compiled before it is sharded (torchtitan's order); its rows add `optimizer_state_bytes`, rank 0's
shard of the AdamW state. --size tiny (transformer, linear3, mlp, llama_tch, unet_tch, convnext_tch, vit_tch) is
for a CPU check.

    torchrun --nproc-per-node 2 docs/benchmarks/pytorch_reference.py --ddp --only transformer,linear3 --json ddp.json
    torchrun --nproc-per-node 2 docs/benchmarks/pytorch_reference.py --fsdp --only transformer,linear3 --json fsdp.json
"""

import argparse
import ctypes
import gc
import json
import math
import os
import sys
import threading
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.checkpoint
except ImportError as error:
    print(f"cannot import torch: {error}; install it with "
          "`pip install -r requirements-torch.txt`", file=sys.stderr)
    sys.exit(4)

# One line: speedkit/src/bench/peer.rs checks it against REFERENCE_WORKLOADS, joined by ", ".
WORKLOADS = ("transformer", "linear3", "mlp", "resnet", "mlp_block", "transformer_checkpointed", "transformer_tch", "gpt2", "gpt2_tch", "llama_tch", "unet_tch", "llama_large", "convnext_tch", "vit_tch")


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
    def __init__(self, vocab=8192, d=768, heads=12, layers=6, seq=512, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        self.tok = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, targets):
        x = F.embedding(tokens, self.tok) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class RMSNorm(nn.Module):
    """Meta's reference RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, cast back, times a scale."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """speedkit_suite::models::LlamaTch: RMSNorm, rotary embeddings, SwiGLU, no biases."""

    def __init__(self, vocab=32000, d=1024, heads=16, layers=8, hidden=2816, seq=1024):
        super().__init__()
        self.tok = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        head_dim = d // heads
        inv_freq = torch.exp(torch.arange(0, head_dim, 2).float() / head_dim * -math.log(10000.0))
        freqs = torch.outer(torch.arange(seq).float(), inv_freq)
        both = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", both.cos(), persistent=False)
        self.register_buffer("sin", both.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = F.embedding(tokens, self.tok)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    @staticmethod
    def flops(batch, seq, vocab, d, layers, hidden, **_):
        """LlamaConfig::flops_per_step."""
        return (6 * batch * seq * (layers * (4 * d * d + 3 * d * hidden) + d * vocab)
                + 3 * layers * 2 * batch * seq**2 * d)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, groups):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(h))) + self.skip(x)


class Unet(nn.Module):
    """speedkit_suite::models::UnetTch: GroupNorm + SiLU residual blocks, stride-2 down, nearest up,
    skip concatenation; MSE against noise."""

    def __init__(self, channels=3, base=64, groups=32):
        super().__init__()
        c = base
        self.conv_in = nn.Conv2d(channels, c, 3, padding=1)
        self.down1, self.downsample1 = ResBlock(c, c, groups), nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.down2 = ResBlock(c, 2 * c, groups)
        self.downsample2 = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)
        self.mid1, self.mid2 = ResBlock(2 * c, 4 * c, groups), ResBlock(4 * c, 4 * c, groups)
        self.up2, self.dec2 = nn.Conv2d(4 * c, 4 * c, 3, padding=1), ResBlock(6 * c, 2 * c, groups)
        self.up1, self.dec1 = nn.Conv2d(2 * c, 2 * c, 3, padding=1), ResBlock(3 * c, c, groups)
        self.norm_out, self.conv_out = nn.GroupNorm(groups, c), nn.Conv2d(c, channels, 3, padding=1)

    def forward(self, images, noise):
        skip1 = self.down1(self.conv_in(images))
        skip2 = self.down2(self.downsample1(skip1))
        mid = self.mid2(self.mid1(self.downsample2(skip2)))
        x = self.dec2(torch.cat((self.up2(F.interpolate(mid, scale_factor=2, mode="nearest")), skip2), 1))
        x = self.dec1(torch.cat((self.up1(F.interpolate(x, scale_factor=2, mode="nearest")), skip1), 1))
        return F.mse_loss(self.conv_out(F.silu(self.norm_out(x))), noise)

    @staticmethod
    def flops(batch, size, channels, base, **_):
        """UnetConfig::flops_per_step."""
        def conv(cin, cout, k, side):
            return 2 * batch * cin * cout * k * k * side * side

        def res(cin, cout, side):
            return conv(cin, cout, 3, side) + conv(cout, cout, 3, side) + (conv(cin, cout, 1, side) if cin != cout else 0)

        c, s = base, size
        return 3 * (conv(channels, c, 3, s) + res(c, c, s) + conv(c, c, 3, s // 2) + res(c, 2 * c, s // 2)
                    + conv(2 * c, 2 * c, 3, s // 4) + res(2 * c, 4 * c, s // 4) + res(4 * c, 4 * c, s // 4)
                    + conv(4 * c, 4 * c, 3, s // 2) + res(6 * c, 2 * c, s // 2) + conv(2 * c, 2 * c, 3, s)
                    + res(3 * c, c, s) + conv(c, channels, 3, s))


class ConvnextBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.scale = nn.Parameter(torch.full((c,), 0.1))

    def forward(self, x):
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.fc2(F.gelu(self.fc1(h))) * self.scale
        return x + h.permute(0, 3, 1, 2)


class ChannelsNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW image: channels-last, normed, and back."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Convnext(nn.Module):
    """speedkit_suite::models::ConvnextTch: a 4×4 stem, stages of 7×7 depthwise convolution,
    channels LayerNorm, an erf-GELU MLP and layer scale, 2×2 stride-2 downsampling, a pooled,
    normed head; cross-entropy."""

    def __init__(self, channels=3, base=96, depths=(3, 3, 9, 3), classes=1000):
        super().__init__()
        widths = [base << s for s in range(4)]
        self.stem = nn.Sequential(nn.Conv2d(channels, base, 4, stride=4), ChannelsNorm(base))
        self.downsamples = nn.ModuleList(
            nn.Sequential(ChannelsNorm(widths[s - 1]), nn.Conv2d(widths[s - 1], widths[s], 2, stride=2))
            for s in range(1, 4))
        self.stages = nn.ModuleList(nn.Sequential(*(ConvnextBlock(widths[s]) for _ in range(depths[s])))
                                    for s in range(4))
        self.head_norm, self.head = nn.LayerNorm(widths[3]), nn.Linear(widths[3], classes)

    def forward(self, images, labels):
        x = self.stages[0](self.stem(images))
        for down, stage in zip(self.downsamples, self.stages[1:]):
            x = stage(down(x))
        logits = self.head(self.head_norm(x.mean((2, 3), dtype=torch.float32)))
        return F.cross_entropy(logits, labels)

    @staticmethod
    def flops(batch, size, channels, base, depths, classes, **_):
        """ConvnextConfig::flops_per_step."""
        side = size // 4
        forward = 2 * batch * channels * base * 16 * side * side
        for stage, depth in enumerate(depths):
            c = base << stage
            if stage:
                side //= 2
                forward += 2 * batch * (c // 2) * c * 4 * side * side
            forward += depth * 2 * batch * side * side * (49 * c + 8 * c * c)
        return 3 * (forward + 2 * batch * (base << 3) * classes)


class VitBlock(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.p = heads, p

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        h = F.dropout(F.gelu(self.fc1(self.ln2(x))), self.p, self.training)
        return x + F.dropout(self.fc2(h), self.p, self.training)


class Vit(nn.Module):
    """speedkit_suite::models::VitTch: patches by a strided convolution, a class token, learned
    positions, pre-LN blocks with SDPA and an erf-GELU MLP, dropout after the embeddings, the
    attention's projection and around the MLP's second layer, a normed head on the class token;
    cross-entropy."""

    def __init__(self, size=224, patch=16, channels=3, d=384, heads=6, layers=12, classes=1000, p=0.1):
        super().__init__()
        tokens = (size // patch) ** 2 + 1
        self.patches = nn.Conv2d(channels, d, patch, stride=patch)
        self.class_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, tokens, d) * 0.02)
        self.blocks = nn.ModuleList(VitBlock(d, heads, p) for _ in range(layers))
        self.ln_f, self.head, self.p = nn.LayerNorm(d), nn.Linear(d, classes), p

    def forward(self, images, labels):
        patches = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(images.shape[0], 1, -1), patches], 1) + self.positions
        x = F.dropout(x, self.p, self.training)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)[:, 0]), labels)

    @staticmethod
    def flops(batch, size, patch, channels, d, layers, classes, **_):
        """VitConfig::flops_per_step."""
        t = (size // patch) ** 2 + 1
        embed = 2 * batch * (t - 1) * channels * patch * patch * d
        block = 2 * batch * t * 12 * d * d + 4 * batch * t * t * d
        return 3 * (embed + layers * block + 2 * batch * d * classes)


class Linear3(nn.Module):
    def __init__(self, width=8192):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))

    def forward(self, x, target):
        return F.mse_loss(self.layers(x), target)


class MlpBlock(nn.Module):
    """speedkit's mlp_block: LayerNorm → Linear(4096, 16384) → GELU (tanh) → Linear(16384, 4096) →
    residual, MSE against a target."""

    def __init__(self, width=4096, hidden=16384):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x, target):
        y = x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))
        return F.mse_loss(y, target)


class Mlp(nn.Module):
    def __init__(self, inputs=512, hidden=1024, classes=10):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x, labels):
        return F.cross_entropy(self.layers(x), labels)


class ConvBn(nn.Module):
    def __init__(self, cin, cout, k, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.c2 = ConvBn(cin, cout, 3, stride), ConvBn(cout, cout, 3, 1)
        self.shortcut = ConvBn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = self.c2(F.relu(self.c1(x)))
        return F.relu(y + (self.shortcut(x) if self.shortcut is not None else x))


class ResNet18(nn.Module):
    """The CIFAR ResNet-18 of speedkit_suite::models::resnet (3x3 stem, no max-pool)."""

    WIDTHS = (64, 128, 256, 512)

    def __init__(self, classes=10):
        super().__init__()
        self.stem = ConvBn(3, 64, 3, 1)
        blocks, cin = [], 64
        for stage, width in enumerate(self.WIDTHS):
            for i in range(2):
                blocks.append(BasicBlock(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images, labels):
        x = self.blocks(F.relu(self.stem(images)))
        return F.cross_entropy(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)), labels)

    @classmethod
    def flops_per_step(cls, batch=256, size=32, classes=10):
        conv = lambda cin, cout, k, hw: 2 * batch * cin * cout * k * k * hw * hw
        hw, cin = size, 64
        forward = conv(3, 64, 3, hw)
        for stage, width in enumerate(cls.WIDTHS):
            for i in range(2):
                stride = 2 if stage > 0 and i == 0 else 1
                hw = (hw + stride - 1) // stride
                forward += conv(cin, width, 3, hw) + conv(width, width, 3, hw)
                if stride != 1 or cin != width:
                    forward += conv(cin, width, 1, hw)
                cin = width
        return 3 * (forward + 2 * batch * cin * classes)


# The tiny sizes of speedkit_suite's models (src/models/), for a data-parallel check on the CPU.
TINY = dict(transformer=dict(vocab=128, d=32, heads=2, layers=2, seq=16, batch=2),
            linear3=dict(width=64, batch=8), mlp=dict(inputs=32, hidden=64, classes=10, batch=16),
            llama_tch=dict(vocab=128, d=32, heads=2, layers=2, hidden=88, seq=16, batch=2),
            unet_tch=dict(batch=2, size=16, channels=3, base=8, groups=4),
            convnext_tch=dict(batch=2, size=32, channels=3, base=8, depths=(1, 1, 1, 1), classes=10),
            vit_tch=dict(batch=2, size=32, patch=8, channels=3, d=32, heads=2, layers=2, classes=10))


def transformer_flops(batch, seq, vocab, d, layers, **_):
    """Matmul FLOPs of a step: weights 12 d^2 per block and the head, and causal attention's
    two matmuls, each x3 for forward + backward (the formula of TransformerConfig)."""
    return 6 * batch * seq * (layers * 12 * d * d + d * vocab) + 3 * layers * 2 * batch * seq**2 * d


def workload(name, device, size="bench", batch=None):
    """(model, batch, flops per step, (items per step, unit)) of a reference workload; `batch`
    overrides the transformers' (--largest-batch)."""
    torch.manual_seed(0)
    # transformer_tch and gpt2_tch are speedkit's model written with tch's own modules, gpt2 on
    # speedkit::nn; this reference is plain PyTorch already, so their twin is this same Transformer
    # (gpt2 and gpt2_tch at GPT-2 small's size: speedkit_suite::models::gpt2_small).
    if name in ("transformer", "transformer_checkpointed", "transformer_tch", "gpt2", "gpt2_tch"):
        if size == "tiny":
            c = TINY["transformer"]
        elif name in ("gpt2", "gpt2_tch"):
            c = dict(vocab=50304, d=768, heads=12, layers=12, seq=1024, batch=8)
        else:
            c = dict(vocab=8192, d=768, heads=12, layers=6, seq=512, batch=32)
        c = dict(c, batch=batch or c["batch"])
        model = Transformer(c["vocab"], c["d"], c["heads"], c["layers"], c["seq"],
                            checkpoint=name == "transformer_checkpointed")
        batch = (torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=device),
                 torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=device))
        flops = transformer_flops(**c)
        items = (c["batch"] * c["seq"], "tokens")
    elif name in ("llama_tch", "llama_large"):
        # llama_large: Llama 2 7B's shape (6.74 B parameters), too large for one GPU with AdamW:
        # it runs under --fsdp over several.
        large = dict(vocab=32000, d=4096, heads=32, layers=32, hidden=11008, seq=512, batch=2)
        c = (TINY["llama_tch"] if size == "tiny" else
             large if name == "llama_large" else
             dict(vocab=32000, d=1024, heads=16, layers=8, hidden=2816, seq=1024, batch=8))
        c = dict(c, batch=batch or c["batch"])
        model = Llama(c["vocab"], c["d"], c["heads"], c["layers"], c["hidden"], c["seq"])
        batch = (torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=device),
                 torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=device))
        flops = Llama.flops(**c)
        items = (c["batch"] * c["seq"], "tokens")
    elif name == "unet_tch":
        c = TINY[name] if size == "tiny" else dict(batch=64, size=64, channels=3, base=64, groups=32)
        model = Unet(c["channels"], c["base"], c["groups"])
        shape = (c["batch"], c["channels"], c["size"], c["size"])
        batch = (torch.randn(shape, device=device), torch.randn(shape, device=device))
        flops = Unet.flops(**c)
        items = (c["batch"], "images")
    elif name == "convnext_tch":
        c = TINY[name] if size == "tiny" else dict(batch=128, size=128, channels=3, base=96,
                                                   depths=(3, 3, 9, 3), classes=1000)
        model = Convnext(c["channels"], c["base"], c["depths"], c["classes"])
        batch = (torch.randn(c["batch"], c["channels"], c["size"], c["size"], device=device),
                 torch.randint(0, c["classes"], (c["batch"],), device=device))
        flops = Convnext.flops(**c)
        items = (c["batch"], "images")
    elif name == "vit_tch":
        c = TINY[name] if size == "tiny" else dict(batch=128, size=224, patch=16, channels=3, d=384,
                                                   heads=6, layers=12, classes=1000)
        model = Vit(c["size"], c["patch"], c["channels"], c["d"], c["heads"], c["layers"], c["classes"])
        batch = (torch.randn(c["batch"], c["channels"], c["size"], c["size"], device=device),
                 torch.randint(0, c["classes"], (c["batch"],), device=device))
        flops = Vit.flops(**c)
        items = (c["batch"], "images")
    elif name == "linear3":
        width, rows = (64, 8) if size == "tiny" else (8192, 512)
        model = Linear3(width)
        batch = (torch.randn(rows, width, device=device), torch.randn(rows, width, device=device))
        flops = 3 * 3 * 2 * rows * width**2
        items = (rows, "samples")
    elif name == "mlp_block" and size != "tiny":
        model = MlpBlock()
        batch = (torch.randn(16384, 4096, device=device), torch.randn(16384, 4096, device=device))
        flops = 12 * 16384 * 4096 * 16384
        items = (16384, "tokens")
    elif name == "mlp":
        c = TINY[name] if size == "tiny" else dict(inputs=512, hidden=1024, classes=10, batch=256)
        model = Mlp(c["inputs"], c["hidden"], c["classes"])
        batch = (torch.randn(c["batch"], c["inputs"], device=device),
                 torch.randint(0, c["classes"], (c["batch"],), device=device))
        flops = 6 * c["batch"] * (c["inputs"] * c["hidden"] + c["hidden"] * c["classes"])
        items = (c["batch"], "samples")
    elif size == "tiny":
        raise ValueError(f"{name} has no tiny size here (tiny: {', '.join(TINY)})")
    else:
        model = ResNet18().to(memory_format=torch.channels_last)
        images = torch.randn(256, 3, 32, 32, device=device)
        batch = (images.contiguous(memory_format=torch.channels_last),
                 torch.randint(0, 10, (256,), device=device))
        flops = ResNet18.flops_per_step()
        items = (256, "images")
    return model.to(device), batch, flops, items


def nearest_rank(sorted_times, p):
    """speedkit's percentile: nearest rank, halves rounded away from zero."""
    return sorted_times[min(len(sorted_times) - 1,
                            int(math.floor(p / 100 * (len(sorted_times) - 1) + 0.5)))]


def start_memory():
    """Empty the cache and reset the peaks: what follows is this run's memory alone."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


class ClockSampler:
    """The GPU's SM clock and board power while the timed steps run: NVML read every 10 ms on a
    thread of its own, summed up as speedkit's runner sums up its own (GpuClocks,
    speedkit/src/bench/clocks.rs; the mean power from the board's energy counter where it counts).
    `start()` gives None where NVML cannot be read."""

    POWER_REASONS, THERMAL_REASONS = 0x4 | 0x80, 0x20 | 0x40  # power cap and brake; thermal

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        # Drivers before 535 name it ...ClocksThrottleReasons.
        self.reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.energy = getattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
        self.started = time.perf_counter()
        self.readings, self.stop = [self.read()], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    @classmethod
    def start(cls):
        if not torch.cuda.is_available():
            return None
        device_index = torch.cuda.current_device()
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                return None
            p = torch.cuda.get_device_properties(device_index)
            bus_id = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(handle)) != 0:
                return None
            return cls(nvml, handle)
        except (OSError, AttributeError, RuntimeError):
            return None

    def read(self):
        """(SM MHz, max SM MHz, power mW, power limit mW, clock-event reasons, energy mJ, seconds
        since the first reading)."""
        values = [ctypes.c_uint() for _ in range(4)]
        reasons, energy = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        if self.energy is None or self.energy(self.handle, ctypes.byref(energy)) != 0:
            energy.value = 0
        self.nvml.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(values[0]))
        self.nvml.nvmlDeviceGetMaxClockInfo(self.handle, 1, ctypes.byref(values[1]))
        self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(values[2]))
        self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(values[3]))
        self.reasons(self.handle, ctypes.byref(reasons))
        return [v.value for v in values] + [reasons.value, energy.value,
                                            time.perf_counter() - self.started]

    def sample(self):
        while not self.stop.wait(0.01):
            self.readings.append(self.read())

    def finish(self):
        self.stop.set()
        self.thread.join()
        r, n = self.readings, len(self.readings)
        clocks = [x[0] for x in r]
        held = lambda reasons: sum(1 for x in r if x[4] & reasons) / n  # noqa: E731
        # The counter moves in steps (every 100 ms on an H200): between its first and last update.
        updates = [b for a, b in zip(r, r[1:]) if b[5] != a[5]]
        first, last = (updates[0], updates[-1]) if updates else (r[0], r[0])
        joules, span = (last[5] - first[5]) / 1e3, last[6] - first[6]
        counted = first[5] > 0 and joules > 0 and span > 0
        power = joules / span if counted else sum(x[2] for x in r) / n / 1e3
        return dict(readings=n, mean_sm_mhz=sum(clocks) / n, min_sm_mhz=min(clocks),
                    top_sm_mhz=max(clocks), max_sm_mhz=r[-1][1],
                    mean_power_w=power, power_limit_w=r[-1][3] / 1e3,
                    power_capped=held(self.POWER_REASONS), thermal=held(self.THERMAL_REASONS))


def time_steps(step, warmup=10, steps=50, sync_every_step=True, started=None):
    """Times `step`; returns (times in ms, in step order; memory dict). start_memory() came first.

    Without sync_every_step the timed steps are queued back to back, each between its own events,
    as speedkit's --no-paranoid-sync does. With `started` (a time.perf_counter() reading), the
    memory dict also gives first_step_s: the seconds from then to the end of the first step
    (compilation included), as speedkit's runner reports its own; and clocks, the GPU's clock and
    power over the timed steps (ClockSampler), where NVML can be read."""
    first_step_s = None
    for i in range(warmup):
        step()
        if i == 0 and started is not None:
            torch.cuda.synchronize()
            first_step_s = time.perf_counter() - started
    torch.cuda.synchronize()
    warm_allocated, warm_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    sampler = ClockSampler.start()
    events = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        if sync_every_step:
            torch.cuda.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    clocks = sampler.finish() if sampler else None
    times = [start.elapsed_time(end) for start, end in events]
    steady = torch.cuda.max_memory_allocated()
    memory = dict(peak_allocated_bytes=max(warm_allocated, steady),
                  peak_reserved_bytes=max(warm_reserved, torch.cuda.max_memory_reserved()),
                  steady_peak_allocated_bytes=steady)
    if first_step_s is not None:
        memory["first_step_s"] = first_step_s
    if clocks is not None:
        memory["clocks"] = clocks
    return times, memory


def summary(times):
    ordered = sorted(times)
    return nearest_rank(ordered, 50), nearest_rank(ordered, 10), nearest_rank(ordered, 90)


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def breakdown(model, opt, memory):
    """Where the run's memory went, as speedkit's MemoryBreakdown (speedkit/src/memory.rs) says
    it: what stays allocated after the last step, split by what holds it; the step's transient
    peak above that; what the allocator reserved beyond the peak; the graphs' private pools."""
    torch.cuda.synchronize()
    params = list(model.parameters())
    parameters = tensor_bytes(params)
    gradients = tensor_bytes(p.grad for p in params)
    state = tensor_bytes(t for s in opt.state.values() for t in s.values())
    allocated = torch.cuda.memory_allocated()
    graph_pools = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                      if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    return dict(parameters=parameters, gradients=gradients, optimizer_state=state, weight_copies=0,
                other_held=max(0, allocated - parameters - gradients - state),
                activations=max(0, memory["peak_allocated_bytes"] - allocated),
                cached=max(0, memory["peak_reserved_bytes"] - memory["peak_allocated_bytes"]),
                graph_pools=graph_pools,
                fragmented=torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0))


def train_step(model, batch, mode):
    """(one training step, its optimizer) in `mode`: eager, graph, or a torch.compile mode."""
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
        return step, opt
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
    return graph.replay, opt


def profile_transformer(device):
    model, batch, _, _ = workload("transformer", device)
    step, _ = train_step(model, batch, "eager")
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
                median, _, _ = summary(time_steps(attention)[0])
                print(f"attention fwd+bwd, one layer, {backend.name}: {median:.3f} ms")
            except RuntimeError as e:
                print(f"attention {backend.name}: {e}".splitlines()[0])


def to_float8(model, recipe="tensorwise"):
    """torchao's FP8 training (Float8Linear) on every nn.Linear: "tensorwise" dynamic scaling, or
    "rowwise" (a scale per row of each GEMM operand, e4m3 everywhere)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def measure(name, mode, device, warmup, steps, sync_every_step=True):
    # The run starts before the model is built, as speedkit's runner counts it.
    started = time.perf_counter()
    model, batch, flops, _ = workload(name, device)
    # "torchao-fp8[-rowwise]": torchao's Float8Linear under torch.compile (default mode), as torchao
    # advises.
    compile_mode = mode
    if mode == "torchao-fp8":
        model, compile_mode = to_float8(model), "default"
    elif mode == "torchao-fp8-rowwise":
        model, compile_mode = to_float8(model, "rowwise"), "default"
    # Before the optimizer exists: its state, compilation and graph capture count in the peaks.
    start_memory()
    step, opt = train_step(model, batch, compile_mode)
    times, memory = time_steps(step, warmup, steps, sync_every_step, started)
    first_step_s = memory.pop("first_step_s", None)
    clocks = memory.pop("clocks", None)
    memory["breakdown"] = breakdown(model, opt, memory)
    median, p10, p90 = summary(times)
    return dict(workload=name, mode=mode, median_ms=median, p10_ms=p10, p90_ms=p90,
                tflops=flops / median / 1e9, times_ms=times, memory=memory,
                first_step_s=first_step_s, clocks=clocks)


def ddp_setup():
    """Joins torchrun's group: (rank, world size, device). NCCL on GPU LOCAL_RANK, else Gloo."""
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("--ddp runs under torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
              "MASTER_PORT): torchrun --nproc-per-node N docs/benchmarks/pytorch_reference.py "
              "--ddp ...", file=sys.stderr)
        sys.exit(2)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def time_steps_host(step, warmup, steps):
    """time_steps on the CPU: the host clock around each step (CPU work is synchronous)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times, None


def shard_units(model):
    """The submodules FSDP2 shards one by one: the items of the model's first list of layers
    (Transformer.blocks, Linear3.layers), or none (the model is then one unit)."""
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            return list(child)
    return []


def fsdp2(model, compiled):
    """`model` under FSDP2 (fully_shard per unit, then the root), bf16 parameters for compute and
    fp32 gradient reduction; with `compiled`, each unit compiled before it is sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units(model):
        if compiled:
            unit.compile()
        fully_shard(unit, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def ddp_train_step(model, batch, device, compiled=False, sharded=False):
    """The AMP step of train_step, on a DistributedDataParallel replica (gradients averaged in
    25 MiB buckets during backward, as speedkit's default): eager, or under torch.compile's default
    mode where `compiled` (DDP's recommended pairing: its DDPOptimizer splits the graph at bucket
    boundaries so the all-reduce still overlaps the backward pass). With `sharded`, FSDP2 in place
    of DDP (see fsdp2). Returns (step, optimizer)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if sharded:
        replica = fsdp2(model, compiled)
    else:
        ids = [device.index] if device.type == "cuda" else None
        replica = DDP(model, device_ids=ids, bucket_cap_mb=25)
        if compiled:
            replica = torch.compile(replica)
    opt = torch.optim.AdamW(replica.parameters(), lr=3e-4, weight_decay=0.1,
                            fused=device.type == "cuda", foreach=device.type != "cuda" or None)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = replica(*batch)
        loss.backward()
        opt.step()

    return step, opt


def local_bytes(tensors):
    """Bytes this rank holds of `tensors` (a DTensor's local shard, not its global size)."""
    return tensor_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)


def measure_ddp(name, device, size, world, warmup, steps, sync_every_step=True, compiled=False,
                sharded=False):
    """One rank's run of `name` under DDP (FSDP2 where `sharded`); every rank returns the row with
    every rank's median."""
    import torch.distributed as dist
    model, batch, flops, (items, unit) = workload(name, device, size)
    step, opt = ddp_train_step(model, batch, device, compiled, sharded)
    if device.type == "cuda":
        start_memory()
        times, memory = time_steps(step, warmup, steps, sync_every_step)
    else:
        times, memory = time_steps_host(step, warmup, steps)
    clocks = memory.pop("clocks", None)
    median, p10, p90 = summary(times)
    # A tensor all-gather (all_gather_object needs NumPy), on the device the backend serves.
    gathered = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(median, dtype=torch.float64, device=device))
    medians = [t.item() for t in gathered]
    rates = [items / (ms * 1e-3) for ms in medians]
    throughput = dict(unit=unit, world_size=world, per_rank=rates, total=sum(rates),
                      per_gpu=sum(rates) / world)
    mode = ("fsdp2" if sharded else "ddp") + ("_compile" if compiled else "")
    state = local_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return dict(workload=name, mode=mode, median_ms=median,
                p10_ms=p10, p90_ms=p90,
                tflops=flops / median / 1e9, times_ms=times, memory=memory, world_size=world,
                median_ms_per_rank=medians, throughput=throughput, optimizer_state_bytes=state,
                clocks=clocks)


LARGE = ("llama_large",)
BATCHED = ("transformer", "transformer_checkpointed", "transformer_tch", "gpt2", "gpt2_tch", "llama_tch",
           "llama_large")


def trains_at(name, mode, device, batch):
    """The peak allocated when `name` trains at `batch` in `mode` (5 steps: warm-up, compilation
    and capture included), None when it runs out of memory. Everything is given back after."""
    model = data = step = opt = None
    try:
        model, data, _, _ = workload(name, device, batch=batch)
        start_memory()
        step, opt = train_step(model, data, mode)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, data, step, opt
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def largest_batch(name, mode, device, start):
    """The largest batch `name` trains at in `mode`, searched as speedkit's runner searches
    (speedkit/src/bench/runner/largest.rs): doubling from `start` until a batch runs out of memory
    (at most 64x), then halving the interval until it is within an eighth of the answer."""
    tried = []

    def fits(batch):
        peak = trains_at(name, mode, device, batch)
        tried.append(dict(batch=batch, peak_allocated_bytes=peak))
        return peak is not None

    fitting, failing = 0, None
    batch = start
    while failing is None and batch <= 64 * start:
        if fits(batch):
            fitting, batch = batch, 2 * batch
        else:
            failing = batch
    while failing is not None and fitting > 0 and failing - fitting > max(1, fitting // 8):
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    peak = next((t["peak_allocated_bytes"] for t in tried if t["batch"] == fitting), None)
    return dict(workload=name, mode=mode, largest_batch=fitting, first_failing=failing,
                peak_allocated_bytes=peak, tried=tried)


def describe(row):
    if row.get("error"):
        return f"{row['workload']:12} {row['mode']:16} failed: {row['error']}"
    gib = lambda b: b / 2**30
    m = row["memory"]
    if row.get("throughput"):
        t = row["throughput"]
        head = (f"{row['workload']:12} {row['mode']:16} {row['median_ms']:8.3f} ms  "
                f"p10 {row['p10_ms']:.3f}  p90 {row['p90_ms']:.3f}  ranks "
                + " ".join(f"{ms:.3f}" for ms in row["median_ms_per_rank"])
                + f" ms  {t['per_gpu']:.0f} {t['unit']}/s per GPU, {t['total']:.0f} {t['unit']}/s "
                f"in total over {t['world_size']} rank{'s' if t['world_size'] > 1 else ''}")
        if m is None:
            return head
        state = row.get("optimizer_state_bytes")
        return (head + f"  peak {gib(m['peak_allocated_bytes']):.2f} GiB"
                + (f", optimizer state {gib(state):.2f} GiB" if state is not None else ""))
    return (f"{row['workload']:12} {row['mode']:16} {row['median_ms']:8.3f} ms  "
            f"p10 {row['p10_ms']:.3f}  p90 {row['p90_ms']:.3f}  {row['tflops']:.1f} TFLOP/s  "
            f"peak {gib(m['peak_allocated_bytes']):.2f} GiB  reserved "
            f"{gib(m['peak_reserved_bytes']):.2f} GiB  steady {gib(m['steady_peak_allocated_bytes']):.2f} GiB")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--torchao-fp8", action="store_true",
                        help="also time torchao's Float8Linear with torch.compile (needs torchao)")
    parser.add_argument("--torchao-fp8-rowwise", action="store_true",
                        help="also time torchao's Float8Linear with row-wise scaling and torch.compile")
    parser.add_argument("--only", help="comma-separated workloads (others are skipped with a note)")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-paranoid-sync", action="store_true",
                        help="queue timed steps back to back instead of synchronising after each")
    parser.add_argument("--json")
    parser.add_argument("--json-lines", action="store_true")
    parser.add_argument("--ddp", action="store_true",
                        help="data-parallel under torchrun (DistributedDataParallel, eager AMP)")
    parser.add_argument("--fsdp", action="store_true",
                        help="as --ddp, under FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--largest-batch", metavar="MODE[,MODE]",
                        help="instead of timing, find the largest batch the transformers train at "
                             "in each MODE (eager, default, reduce-overhead)")
    args = parser.parse_args()
    if args.ddp or args.fsdp:
        return main_ddp(args)
    if not torch.cuda.is_available():
        print(f"the PyTorch reference times CUDA work and torch {torch.__version__} sees no CUDA "
              "device: run it on a machine with an NVIDIA GPU and a CUDA build of torch",
              file=sys.stderr)
        sys.exit(3)
    if args.size != "bench":
        print(f"the PyTorch reference runs the bench size only, not {args.size}: "
              "run with --size bench", file=sys.stderr)
        sys.exit(5)
    names = selected(args)
    human = sys.stderr if args.json_lines else sys.stdout
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
               cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               python=sys.version.split()[0])
    print(f"torch {env['torch']}, {env['gpu']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}",
          file=human, flush=True)
    if args.json_lines:
        print(json.dumps(dict(environment=env)), flush=True)
    if args.profile:
        profile_transformer(device)
    if args.largest_batch:
        return main_largest_batch(args, names, device, env, human)
    results = []
    modes = (["eager"] + (["graph"] if args.graph else [])
             + (["default", "reduce-overhead"] if args.compile else [])
             + (["torchao-fp8"] if args.torchao_fp8 else [])
             + (["torchao-fp8-rowwise"] if args.torchao_fp8_rowwise else []))
    for name in names:
        for mode in modes:
            try:
                row = measure(name, mode, device, args.warmup, args.steps,
                              not args.no_paranoid_sync)
            except Exception as error:  # one failed mode (e.g. no Triton) must not end the run
                row = dict(workload=name, mode=mode, error=str(error).splitlines()[0])
            results.append(row)
            print(describe(row), file=human, flush=True)
            if args.json_lines:
                print(json.dumps(row), flush=True)
            if mode in ("default", "reduce-overhead", "torchao-fp8", "torchao-fp8-rowwise"):
                torch._dynamo.reset()  # frees compiled graphs and their CUDA-graph pools
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            sync = "queued back to back" if args.no_paranoid_sync else "synchronised after every step"
            json.dump(dict(environment=env, protocol=f"{args.warmup} warm-up + {args.steps} timed "
                           f"steps, CUDA events, {sync}; memory over the whole run (warm-up, "
                           "compilation and capture included)",
                           results=results), f, indent=2)


def main_largest_batch(args, names, device, env, human):
    rows = []
    for name in (n for n in names if n in BATCHED):
        for mode in args.largest_batch.split(","):
            row = largest_batch(name, mode, device, start=32)
            rows.append(row)
            print(f"{name:24} {mode:16} largest batch {row['largest_batch']} (first failing: "
                  f"{row['first_failing']})", file=human, flush=True)
            if args.json_lines:
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, largest_batch=rows), f, indent=1)


def selected(args, known=WORKLOADS, quiet=False):
    """The workloads of --only that have a PyTorch version here at --size (a note for each other
    one, unless quiet)."""
    if not args.only:
        # Too large for one GPU: run only where named (under --fsdp over several).
        return [n for n in known if n not in LARGE]
    asked = [n for n in args.only.split(",") if n]
    for n in asked:
        if n not in known and not quiet:
            print(f"note: {n} has no PyTorch version here at the {args.size} size "
                  f"(known: {', '.join(known)})", file=sys.stderr)
    return [n for n in asked if n in known]


def main_ddp(args):
    """--ddp and --fsdp: every rank runs every workload; rank 0 prints and writes (see the module
    docs)."""
    import torch.distributed as dist
    if args.ddp and args.fsdp:
        print("--ddp and --fsdp are two peers: give one", file=sys.stderr)
        sys.exit(2)
    wrapper, flag = ("FSDP2", "--fsdp") if args.fsdp else ("DDP", "--ddp")
    if args.graph or args.profile or args.json_lines:
        print(f"{flag} times eager AMP (and with --compile, torch.compile's default mode): leave "
              "out --graph, --profile and --json-lines", file=sys.stderr)
        sys.exit(2)
    if args.size not in ("bench", "tiny"):
        print(f"--size is bench or tiny, not {args.size}", file=sys.stderr)
        sys.exit(5)
    rank, world, device = ddp_setup()
    names = selected(args, tuple(TINY) if args.size == "tiny" else WORKLOADS, quiet=rank != 0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    env = dict(torch=torch.__version__, python=sys.version.split()[0], world_size=world,
               backend=dist.get_backend(),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None)
    if rank == 0:
        print(f"torch {env['torch']}, {env['gpu']}, {wrapper} over {world} rank(s) ({env['backend']})",
              flush=True)
    results = []
    for name in names:
        row = measure_ddp(name, device, args.size, world, args.warmup, args.steps,
                          not args.no_paranoid_sync, compiled=args.compile, sharded=args.fsdp)
        results.append(row)
        if rank == 0:
            print(describe(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        timer = "CUDA events" if device.type == "cuda" else "host clock"
        sync = "queued back to back" if args.no_paranoid_sync else "synchronised after every step"
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, world_size=world,
                           protocol=f"{wrapper} over {world} rank(s), each timing its own steps: "
                           f"{args.warmup} warm-up + {args.steps} timed steps, {timer}, {sync}; "
                           "the row's figures are rank 0's, median_ms_per_rank every rank's",
                           results=results), f, indent=2)
    # Every rank leaves together: a rank that tears Gloo down while rank 0 still writes can abort.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
