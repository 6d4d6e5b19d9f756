"""What every benchmark script shares: where results go. Scripts run as `python benchmarks/X.py`,
so this directory is on sys.path and `from common import append_results` works."""
from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def append_results(text: str) -> None:
    """Append a section to benchmarks/RESULTS.md, re-read just before writing (another benchmark
    may have appended its own since this one started), separated by one blank line."""
    prev = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
    with open(RESULTS, "w") as f:
        f.write(prev.rstrip("\n") + "\n\n" + text.strip("\n") + "\n")
