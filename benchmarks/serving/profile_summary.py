"""Where a server process spends its time, from py-spy's raw (collapsed-stack) files.

    python benchmarks/serving/profile_summary.py DIR_OR_FILES... [--top 25]

For each file (serve_bench.py --profile-dir writes one per process and rate): the functions with the
largest inclusive share of the samples (the function or anything it called was on the stack) and the
largest self share (the innermost frame). With `--idle` samples, a process waiting (in its poll, on a
socket, on the GPU through a synchronising copy) shows as the frame it waits in.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            stacks.append((frames.split(";"), int(count)))
    return stacks


def function_of(frame: str) -> str:
    """'name (file:line)' -> 'name (file)': one entry per function, not per line of it."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def summarize(path: str, top: int) -> str:
    stacks = read_stacks(path)
    total = sum(count for _, count in stacks) or 1
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        functions = [function_of(frame) for frame in frames]
        for function in set(functions):
            inclusive[function] += count
        own[frames[-1]] += count
    lines = [f"== {os.path.basename(path)}: {total} samples", "inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {function}" for function, n in inclusive.most_common(top)]
    lines.append("self:")
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="raw py-spy files, or folders of them")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    files = []
    for path in args.paths:
        files += (sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".txt"))
                  if os.path.isdir(path) else [path])
    if not files:
        parser.error("no profile files found")
    print("\n\n".join(summarize(path, args.top) for path in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
