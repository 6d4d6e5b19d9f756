"""Try every malformed input of tests/malformed.py and count the clean refusals (exit 2, exactly one
`config error:` line, no traceback, run.dir untouched). Runs `mode train --print-config ...` in
this process, so 150 cases take seconds.

    .venv/bin/python benchmarks/reliability.py              # this checkout
    .venv/bin/python benchmarks/reliability.py --code DIR   # another checkout's `mode` (e.g. main)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.malformed import all_cases, run_case  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", help="import `mode` from this checkout instead")
    p.add_argument("-v", action="store_true", help="print every case that is not refused cleanly")
    a = p.parse_args()
    if a.code:
        sys.path.insert(0, str(Path(a.code).resolve()))
        for m in [m for m in sys.modules if m == "mode" or m.startswith("mode.")]:
            del sys.modules[m]
    import mode

    cases = all_cases()
    tried, clean, by_kind = Counter(), Counter(), {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kind, name, spec) in enumerate(cases):
            res = run_case(kind, spec, Path(tmp) / str(i))
            tried[kind] += 1
            clean[kind] += res["clean"]
            if not res["clean"]:
                by_kind.setdefault(kind, []).append((name, res))
    print(f"mode from {Path(mode.__file__).parent}")
    print("| inputs | tried | refused cleanly |\n| --- | --- | --- |")
    for k in tried:
        print(f"| {k} | {tried[k]} | {clean[k]} |")
    total, ok = sum(tried.values()), sum(clean.values())
    print(f"| **all** | **{total}** | **{ok} ({ok / total:.0%})** |")
    if a.v:
        for kind, bad in by_kind.items():
            for name, res in bad:
                last = res["lines"][-1][:160] if res["lines"] else "(nothing on stderr)"
                print(f"  {kind}: {name}: exit {res['rc']}, {len(res['lines'])} lines: {last}")
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
