"""Stop sequences in the sampler (issues #14, #11 item 5): what stopping a row at its stop string
saves against main's way (generate all max_new_tokens, then cut the text), side by side in one
run (interleaved, best of R), and what the per-step stop check costs when nothing stops.

Workload: B prompts (EOS + 32 random ASCII bytes), N new tokens sampled at temperature 1 (seeded;
an untrained model's greedy text repeats one byte), ids limited to ASCII so one token is one
character. Two scenarios: `spread`: row i gets a stop string that first occurs ending at step
~(i + 1) N / B (taken from the row's own text without stops) and the last row never stops, so the
decode still runs N steps with fewer rows; `half`: row i stops at ~(i + 1) N / (2B), so every row
has stopped by N / 2 and the loop ends there (lm-eval's usual case: max_gen_toks is a cap). Outputs
of both ways are checked equal. Not a test: prints a markdown table (`--write`
appends it to benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode.config import load_config  # noqa: E402
from mode.data import ByteTokenizer  # noqa: E402
from mode.generate import cut_at_stop, generate_ids  # noqa: E402
from mode.model import build_model  # noqa: E402
from common import append_results  # noqa: E402  (benchmarks/common.py)

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOK = ByteTokenizer()


def stop_at(text: str, step: int) -> str:
    """The shortest substring of `text` ending at character `step` whose first occurrence it is."""
    for a in range(step - 1, -1, -1):
        if text.find(text[a : step + 1]) == a:
            return text[a : step + 1]
    return text[: step + 1]


def timed(fn, counter):
    counter.clear()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out, sum(counter)


def compare(model, prompts, N, kw, stops, never, full, seen, repeats) -> str:
    """Table cells: the two ways side by side (interleaved, best of `repeats`), and the check's cost."""
    ways = {
        "cut": lambda: [cut_at_stop(TOK.decode(f), s) for f, s in zip(generate_ids(model, prompts, N, **kw), stops)],
        "stop": lambda: [cut_at_stop(TOK.decode(f), s) for f, s in
                         zip(generate_ids(model, prompts, N, stop=stops, decode=TOK.decode, **kw), stops)],
        "never": lambda: generate_ids(model, prompts, N, stop=never, decode=TOK.decode, **kw),
        "plain": lambda: generate_ids(model, prompts, N, **kw),
    }
    best, outs, steps = {k: float("inf") for k in ways}, {}, {}
    for _ in range(repeats):
        for k, fn in ways.items():
            dt, outs[k], steps[k] = timed(fn, seen)
            best[k] = min(best[k], dt)
    assert outs["cut"] == outs["stop"], "stopping in the sampler changed a completion"
    assert outs["never"] == outs["plain"] == full
    return (f"{steps['cut']} | {steps['stop']} | {best['cut']:.2f} s | {best['stop']:.2f} s | "
            f"{best['cut'] / best['stop']:.2f}x | {best['never']:.2f} s | {best['never'] / best['plain'] - 1:+.1%} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="dense,mod,mode_integrated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--scenarios", default="spread,half")
    p.add_argument("--write", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides for the presets, e.g. model.d_model=512")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    B, N = a.batch, a.new
    g = torch.Generator().manual_seed(0)
    prompts = [[TOK.eos_id] + torch.randint(32, 127, (32,), generator=g).tolist() for _ in range(B)]
    kw = dict(temperature=1.0, seed=1, eos_id=TOK.eos_id, vocab_limit=128)
    rows = ["| preset | scenario | row-steps, cut after | row-steps, stop in sampler | time, cut after | time, stop in sampler "
            "| speedup | time, stops never match | check overhead |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for preset in a.presets.split(","):
        cfg = load_config(os.path.join(ROOT, f"configs/tiny/{preset}.yaml"),
                          [f"model.max_seq_len={33 + N}", f"data.seq_len={33 + N}", *a.overrides])
        torch.manual_seed(0)
        model = build_model(cfg.model).eval()
        seen: list[int] = []
        model.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
        full = generate_ids(model, prompts, N, **kw)
        texts = [TOK.decode(f) for f in full]
        assert all(len(f) == N and t.isascii() for f, t in zip(full, texts)), "an EOS or non-ASCII byte"
        never = [["\x00never"]] * B
        for scenario in a.scenarios.split(","):
            if scenario == "spread":
                stops = [[stop_at(t, (i + 1) * N // B - 1)] for i, t in enumerate(texts[:-1])] + never[:1]
            else:
                stops = [[stop_at(t, (i + 1) * N // (2 * B) - 1)] for i, t in enumerate(texts)]
            cells = compare(model, prompts, N, kw, stops, never, full, seen, a.repeats)
            rows.append(f"| {preset} | {scenario} | {cells}")
    load = os.getloadavg()[0]
    over = "".join(f" {o}" for o in a.overrides)
    head = (f"\n`python benchmarks/bench_stop.py --batch {B} --new {N} --threads {a.threads}{over}`. "
            f"{platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the end, torch "
            f"{torch.__version__}, fp32, untrained configs/tiny presets (d_model {cfg.model.d_model}, "
            f"{cfg.model.n_layers} layers), {B} prompts of 33 tokens, {N} new tokens sampled at temperature 1; "
            f"spread: row i's stop string completes at step ~(i+1)N/B, the last row never stops; half: at "
            f"~(i+1)N/(2B); best of {a.repeats}, interleaved. Row-steps: rows carried by the forwards (prefill "
            f"included). Check overhead: stop strings that never match vs none (the per-step host decode).\n")
    table = head + "\n" + "\n".join(rows) + "\n"
    print(table)
    if a.write:
        append_results(table)


if __name__ == "__main__":
    main()
