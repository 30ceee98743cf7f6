"""Time generated kernels alone: each source NVRTC compiles for this GPU, launched through the CUDA
driver on PyTorch's current stream over random inputs, the median of 7 × 20 launches. Variants of
one kernel (hand edits of its source that keep its entry point's name) are checked against the
first file of that name: each output's largest gap to it. The launches are replayed from a CUDA
graph, so a short kernel's time is not the host's.

    SPEEDKIT_FUSION_SOURCES=DIR bench ... --config examples/configs/auto_fusion.yaml   # the sources
    python3 docs/benchmarks/kernel_alone.py DIR/sk_fused_X.cu[:GRID[:BLOCK]] [EDITED.cu ...]

A kernel's element count is the largest of its functions' coordinate spaces (`COORD` sizes); a
kernel that reduces rows (`row * WIDTH + col`) takes a block per row, any other one block per
`BLOCK * 4` elements; `:GRID` and `:BLOCK` (at most its `__launch_bounds__`) override both. Every tensor argument gets that many
elements (inputs uniform in [0.5, 1.5), results zeroed), the workspace 2^26 zeroed floats, its
counter reset before each launch (a small fill kernel, whose time alone is taken off).
Needs PyTorch with its CUDA 13 wheels (libnvrtc, the CUDA headers) and a GPU.
"""
import argparse
import ctypes
import glob
import os
import re
import statistics

import torch

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "speedkit", "kernels")
TYPES = {"sk::bf16": torch.bfloat16, "sk::f16": torch.float16, "float": torch.float32, "bool": torch.bool}
ENTRY = re.compile(r'extern "C" __global__ (?:__launch_bounds__\((\d+)\) )?void (\w+)\(([^)]*)\)')
SIZES = re.compile(r"COORD\(p, \d+, (\d+)\)|\(idx_t\)\(\(uidx_t\)p / \d+ % (\d+)\)")


def nvrtc():
    import nvidia

    root = os.path.join(list(nvidia.__path__)[0], "cu13")
    return root, ctypes.CDLL(os.path.join(root, "lib", "libnvrtc.so.13"))


ROOT, NVRTC = nvrtc()
DRIVER = None  # libcuda, loaded by main(): compiling needs no GPU


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed ({result})")


def cubin(source, name, arch):
    headers = [(open(f).read().encode(), os.path.basename(f).encode()) for f in glob.glob(KERNELS + "/*.cuh")]
    program, n = ctypes.c_void_p(), len(headers)
    texts = (ctypes.c_char_p * n)(*[h[0] for h in headers])
    names = (ctypes.c_char_p * n)(*[h[1] for h in headers])
    check(NVRTC.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), n, texts, names),
          "nvrtcCreateProgram")
    options = [f"--gpu-architecture=sm_{arch}", f"--include-path={ROOT}/include", "--std=c++17"]
    if NVRTC.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*[o.encode() for o in options])):
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(program, log)
        raise RuntimeError(f"{name} does not compile:\n{log.value.decode()[-3000:]}")
    size = ctypes.c_size_t()
    check(NVRTC.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
    binary = ctypes.create_string_buffer(size.value)
    check(NVRTC.nvrtcGetCUBIN(program, binary), "nvrtcGetCUBIN")
    return binary.raw


class Kernel:
    """One source's entry point, its launch and its tensors (shared by every file of its name)."""

    tensors = {}

    def __init__(self, path, grid=None, block=None):
        source = open(path).read()
        bounds, self.entry, params = ENTRY.search(source).groups()
        self.block = block or int(bounds or 256)
        if bounds and self.block > int(bounds):
            raise ValueError(f"{path}: a block of {self.block} threads, past its __launch_bounds__({bounds})")
        spaces = [int(a or b) for a, b in SIZES.findall(source)]
        self.numel = max((spaces[i] * spaces[i + 1] * spaces[i + 2] * spaces[i + 3]
                          for i in range(0, len(spaces) - 3, 4)), default=1)
        width = re.search(r"row \* (\d+) \+ col", source)
        rows = self.numel // int(width.group(1)) if width else None
        self.count = rows or self.numel
        self.grid = grid or (rows or -(-self.numel // (self.block * 4)))
        major, minor = torch.cuda.get_device_capability()
        module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        check(DRIVER.cuModuleLoadData(ctypes.byref(module), cubin(source, os.path.basename(path), f"{major}{minor}")),
              "cuModuleLoadData")
        check(DRIVER.cuModuleGetFunction(ctypes.byref(self.function), module, self.entry.encode()),
              "cuModuleGetFunction")
        registers, local = ctypes.c_int(), ctypes.c_int()
        DRIVER.cuFuncGetAttribute(ctypes.byref(registers), 4, self.function)
        DRIVER.cuFuncGetAttribute(ctypes.byref(local), 3, self.function)
        self.registers, self.local_bytes = registers.value, local.value
        self.values, self.outputs, self.workspace = [], {}, None
        for param in (p.strip() for p in params.split(",")):
            pointer = re.match(r"(?:const )?([\w:]+)\* (\w+)", param)
            if pointer:
                self.values.append(ctypes.c_uint64(self.tensor(*pointer.groups()).data_ptr()))
            elif param.startswith("long long"):
                self.values.append(ctypes.c_int64(self.count))
            elif param.startswith("double"):
                self.values.append(ctypes.c_double(1.0))
        self.argv = (ctypes.c_void_p * len(self.values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in self.values])

    def tensor(self, type_name, name):
        key = ("ws",) if name == "ws" else (self.entry, name, type_name)
        if key not in Kernel.tensors:
            generator = torch.Generator(device="cuda").manual_seed(len(Kernel.tensors))
            if name == "ws":
                made = torch.zeros(1 << 26, device="cuda")
            elif name.startswith("in"):
                made = (torch.rand(self.numel, device="cuda", generator=generator) + 0.5).to(TYPES[type_name])
            else:
                made = torch.zeros(self.numel, device="cuda", dtype=TYPES[type_name])
            Kernel.tensors[key] = made
        made = Kernel.tensors[key]
        if name == "ws":
            self.workspace = made
        elif name.startswith("out"):
            self.outputs[name] = made
        return made

    def launch(self):
        if self.workspace is not None:
            self.reset()
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(DRIVER.cuLaunchKernel(self.function, self.grid, 1, 1, self.block, 1, 1, 0, stream, self.argv, None),
              "cuLaunchKernel")

    def microseconds(self):
        """The median of 7 replays of a CUDA graph of 20 launches (no host time between them),
        less a graph of the workspace resets alone."""
        for _ in range(5):
            self.launch()
        torch.cuda.synchronize()
        return replayed(self.launch) - (replayed(self.reset) if self.workspace is not None else 0.0)

    def reset(self):
        self.workspace[:1].zero_()


def replayed(work):
    """Microseconds a call of `work` takes in a CUDA graph of 20 calls, the median of 7 replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20 * 1000)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", help="FILE.cu[:GRID[:BLOCK]]")
    args = parser.parse_args()
    global DRIVER
    DRIVER = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")
    first_outputs = {}
    for spec in args.sources:
        path, *launch = spec.split(":")
        kernel = Kernel(path, *(int(x) for x in launch))
        for t in kernel.outputs.values():
            t.zero_()
        kernel.launch()
        torch.cuda.synchronize()
        outputs = {name: t.float().clone() for name, t in kernel.outputs.items()}
        reference = first_outputs.setdefault(kernel.entry, outputs)
        gaps = {name: (outputs[name] - reference[name]).abs().max().item() for name in outputs if reference is not outputs}
        print(f"{os.path.basename(path):40s} grid {kernel.grid:6d} block {kernel.block:5d} "
              f"regs {kernel.registers:3d} local {kernel.local_bytes:4d}  {kernel.microseconds():8.2f} us  "
              f"largest gap {gaps}", flush=True)
    print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
