"""Rebuild the example task data in configs/eval/data/ from the Python standard library's own
sources (present on every machine, and the default training corpus, so a tiny CPU run has
something to score). The jsonl files are shipped: this script only documents how they were made.

    python configs/eval/build_example.py        # rewrites configs/eval/data/*.jsonl

Texts are function bodies from a few stable modules: `stdlib_ppl` scores whole functions
(loglikelihood_rolling), `stdlib_next_line` picks a function's next line among 4 lines
(multiple_choice), `stdlib_complete` completes a line cut in half (generate_until, stop at newline).
Because the stdlib is also the default training corpus, these are smoke tests of the plumbing and
of relative model quality, not held-out benchmarks.
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

MODULES = ["textwrap", "fnmatch", "shlex", "colorsys", "bisect", "heapq", "glob", "calendar"]
OUT = Path(__file__).resolve().parent / "data"


def functions() -> list[str]:
    out = []
    for m in MODULES:
        src = (Path(sysconfig.get_paths()["stdlib"]) / f"{m}.py").read_text()
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if 200 <= len(body) <= 1200 and body.isascii():
                    out.append(body)
    return out


def main() -> None:
    rng = random.Random(0)
    funcs = functions()
    rng.shuffle(funcs)
    OUT.mkdir(exist_ok=True)
    ppl = [{"text": f} for f in funcs[:24]]
    all_lines = sorted({ln for f in funcs for ln in f.splitlines() if len(ln.strip()) > 8})
    mc, gen = [], []
    for f in funcs[24:]:
        lines = f.splitlines()
        cands = [i for i in range(3, len(lines)) if len(lines[i].strip()) > 8]
        if not cands:
            continue
        i = rng.choice(cands)
        wrong = rng.sample([ln for ln in all_lines if ln not in lines], 3)
        choices = wrong + [lines[i]]
        rng.shuffle(choices)
        mc.append({"context": "\n".join(lines[:i]) + "\n", "choices": choices, "gold": choices.index(lines[i])})
        ln = lines[i]
        cut = len(ln) - len(ln.lstrip()) + (len(ln.strip()) // 2)
        gen.append({"context": "\n".join(lines[:i] + [ln[:cut]]), "target": ln[cut:]})
    for name, rows in (("stdlib_ppl", ppl), ("stdlib_next_line", mc[:24]), ("stdlib_complete", gen[:24])):
        with open(OUT / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
