#!/usr/bin/env python3
"""Fails CI on a skipped or ignored test that is not in .ci/allowed-skips.txt.

Reads a test run's output (argument 1): pytest's ``-rs`` lines
(``SKIPPED [n] file:line: reason``) and cargo's ignored tests
(``test name ... ignored``). Each must contain one of the allow-list's
patterns (argument 2: one ``pattern<TAB>why`` per line, ``#`` comments);
a test that cannot run here otherwise fails the run, naming what it lacks.
Prints every skip with its verdict; exits 1 if any is not allowed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main() -> int:
    log, allow_file = Path(sys.argv[1]), Path(sys.argv[2])
    allowed = []
    for line in allow_file.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, why = line.partition("\t")
            allowed.append((pattern.strip(), why.strip()))
    skips = []
    for line in log.read_text(errors="replace").splitlines():
        if re.match(r"^SKIPPED \[\d+\] ", line) or re.match(r"^test \S+ \.\.\. ignored", line):
            skips.append(line.strip())
    bad = 0
    for skip in skips:
        why = next((w for p, w in allowed if p in skip), None)
        if why is None:
            bad += 1
            print(f"ci: skip NOT allowed: {skip}")
        else:
            print(f"ci: skip allowed ({why}): {skip}")
    print(f"ci: {len(skips)} skips, {bad} not in .ci/allowed-skips.txt")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
