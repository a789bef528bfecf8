"""Summarize sitecustomize.py's stack samples: per process file of one phase, where the time went.

    python benchmarks/stacks/summarize.py DIR PHASE [--under FUNC ...] [--depth N]

For each DIR/<pid>-PHASE.txt: the process, its sampled seconds, the functions with the most
inclusive time (leaving out those under every sample), and for each --under function (e.g. scheduler.py:event_loop_overlap) the split of
its time by the calls below it, N levels deep.
"""

import argparse
import collections
from pathlib import Path


def load(path: Path) -> tuple[str, list[tuple[list[str], float]]]:
    lines = path.read_text().splitlines()
    rows = []
    for line in lines[1:]:
        stack, _, s = line.rpartition(" ")
        rows.append((stack.split(";"), float(s)))
    return lines[0], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("phase")
    ap.add_argument("--under", action="append", default=[])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in sorted(args.dir.glob(f"*-{args.phase}.txt")):
        head, rows = load(path)
        total = sum(s for _, s in rows)
        incl: collections.Counter = collections.Counter()
        for stack, s in rows:
            for f in set(stack):
                incl[f] += s
        print(f"\n{path.name}: {head[2:80]} ... sampled {total:.2f} s")
        # (frames under every sample, the process's entry points, say nothing)
        for f, s in [(f, s) for f, s in incl.most_common() if s < 0.99 * total][:args.top]:
            print(f"  {s:8.3f} s  {f}")
        for func in args.under:
            split: collections.Counter = collections.Counter()
            for stack, s in rows:
                if func in stack:
                    k = stack.index(func)
                    split[";".join(stack[k + 1:k + 1 + args.depth]) or "(itself)"] += s
            if split:
                print(f"  under {func} ({sum(split.values()):.3f} s):")
                for f, s in split.most_common(args.top):
                    print(f"    {s:8.3f} s  {f}")


if __name__ == "__main__":
    main()
