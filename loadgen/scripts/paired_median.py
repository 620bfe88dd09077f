#!/usr/bin/env python3
"""The table of a benchmark's alternating pairs and the median of their ratios.

Usage: paired_median.py FILE BASE OTHER BASE_LABEL OTHER_LABEL

FILE holds one line per run, ``MODE VALUE`` (MODE is BASE or OTHER), in the
order they ran; the i-th BASE run and the i-th OTHER run make pair i. Prints
each pair's two values and OTHER/BASE, then the median ratio.
"""

import statistics
import sys


def main() -> None:
    path, base, other, base_label, other_label = sys.argv[1:6]
    with open(path) as f:
        rows = [line.split() for line in f]
    a = [float(v) for m, v in rows if m == base]
    b = [float(v) for m, v in rows if m == other]
    print(f"pair  {base_label:>22}  {other_label:>22}  ratio")
    for i, (x, y) in enumerate(zip(a, b)):
        print(f"{i + 1:4}  {x:22.0f}  {y:22.0f}  {y / x:6.3f}")
    print(
        f"median {other_label} / {base_label}: {statistics.median(y / x for x, y in zip(a, b)):.3f}"
    )


if __name__ == "__main__":
    main()
