"""What is alive at the peak of a recorded memory history: the runner's `--memory-history DIR`
pickles (or any `torch.cuda.memory._dump_snapshot` file) replayed event by event, and the blocks
alive at the moment of the highest allocated total grouped by the frames that allocated them.

    python3 docs/benchmarks/memory_peak.py FILE.pickle [--device N] [--frames K] [--top T] [--largest L]
                                           [--since-capture]

`--frames K` groups by the K innermost frames of interest (speedkit's shim, ATen's operators,
c10d, autograd), 2 by default; `--device` picks the trace (the rank's device; the longest trace by
default). `--largest L` lists the L largest blocks alive at the peak one by one, each with the
event that allocated it and its frames (three times `--frames`). `--since-capture` takes the peak from
the first CUDA graph capture on (the captured step's own peak; the eager warm-up steps before it run
ATen's kernels, and often set the whole run's). Blocks allocated before the history started recording are not in the trace:
the "before the history" line is the peak's allocated total less what the trace accounts for.
"""
import argparse
import collections
import pickle
import sys

# Frames that name who asked for the memory; the allocator's own frames name nothing useful.
INTERESTING = ("sk::", "sk_", "at::native::", "at::_ops::", "c10d::", "torch::autograd::",
               "at::cuda::", "torch::cuda::")
BORING = ("c10::cuda::CUDACachingAllocator", "c10::detail::", "c10::impl::", "std::",
          "at::detail::empty", "at::empty", "c10::Dispatcher", "c10::KernelFunction")


def who(frames, depth):
    names = []
    for frame in frames or []:
        name = frame.get("name", "")
        if any(name.startswith(b) for b in BORING):
            continue
        if any(i in name for i in INTERESTING):
            names.append(name.split("(")[0][:90])
            if len(names) == depth:
                break
    return " < ".join(names) or "(no speedkit, ATen or c10d frame)"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pickle")
    parser.add_argument("--device", type=int)
    parser.add_argument("--frames", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--largest", type=int, default=0)
    parser.add_argument("--since-capture", action="store_true")
    args = parser.parse_args()
    snapshot = pickle.load(open(args.pickle, "rb"))
    traces = snapshot.get("device_traces", [])
    device = args.device if args.device is not None else max(
        range(len(traces)), key=lambda i: len(traces[i]), default=None)
    if device is None or device >= len(traces) or not traces[device]:
        sys.exit(f"{args.pickle}: no device trace to replay")
    live, total, peak, at_peak, peak_event = {}, 0, -1, {}, 0
    frees = {"free_requested", "free_completed"}
    start = 0
    if args.since_capture:
        start = next((n for n, e in enumerate(traces[device])
                      if "capture_begin" in who(e.get("frames"), 99)), None)
        if start is None:
            sys.exit(f"{args.pickle}: no CUDA graph capture in the trace")
        print(f"from the first graph capture on (event {start})")
    for n, event in enumerate(traces[device]):
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            live[addr] = dict(event, index=n)
            total += event["size"]
            if total > peak and n >= start:
                peak, at_peak, peak_event = total, dict(live), n
        elif action in frees and addr in live:
            total -= live.pop(addr)["size"]
    groups = collections.defaultdict(lambda: [0, 0])
    for event in at_peak.values():
        g = groups[who(event.get("frames"), args.frames)]
        g[0] += event["size"]
        g[1] += 1
    gib = 2**30
    print(f"{args.pickle}, device {device}: {len(traces[device])} events; the traced peak is "
          f"{peak / gib:.2f} GiB at event {peak_event}, {len(at_peak)} blocks alive")
    last = traces[device][peak_event]
    print(f"the allocation that reached it: {last['size'] / 2**20:.1f} MiB by "
          f"{who(last.get('frames'), 4)}")
    print(f"{'GiB':>8} {'blocks':>7}  allocated by")
    for name, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / gib:8.3f} {count:7d}  {name}")
    sizes = collections.Counter(e["size"] for e in at_peak.values())
    print("largest block sizes alive at the peak (MiB x count): " +
          ", ".join(f"{s / 2**20:.0f} x {c}" for s, c in sorted(sizes.items(), reverse=True)[:10]))
    for event in sorted(at_peak.values(), key=lambda e: -e["size"])[:args.largest]:
        print(f"{event['size'] / 2**20:9.1f} MiB  event {event['index']:6d}  "
              f"{who(event.get('frames'), 3 * args.frames)}")


if __name__ == "__main__":
    main()
