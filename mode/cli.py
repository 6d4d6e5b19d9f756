"""`mode train | compare | generate | flops | analyze | eval | export`.

Config errors print one `config error:` line and exit 2 before any worker process starts.
"""
from __future__ import annotations

import argparse
import json
import sys


def _flops(argv) -> int:
    from mode.config import load_config
    from mode.flops import count, format_table

    p = argparse.ArgumentParser(prog="mode flops", description="Parameters and forward FLOPs per token.")
    p.add_argument("--config", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--match", metavar="OTHER.yaml", help="solve --knob so FLOPs/token equal OTHER's")
    p.add_argument("--knob", default="model.mod.capacity", help="float field tuned by --match")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if a.match:
        from mode.flops import solve_knob

        target = count(load_config(a.match))["forward_flops_per_token"]
        v = solve_knob(cfg, a.knob, target, 1e-3, 1.0)
        print(f"{a.knob}={v:.6g}  (target {target:.6g} FLOPs/token)")
        cfg = load_config(a.config, a.overrides + [f"{a.knob}={v}"])
    c = count(cfg)
    print(json.dumps(c) if a.json else format_table(c))
    return 0


def _generate(argv) -> int:
    from mode.generate import cli_generate

    p = argparse.ArgumentParser(prog="mode generate", description="Sample with KV cache and causal routing.")
    p.add_argument("--run", required=True, help="run directory (config.yaml, checkpoints/) or `mode export` directory")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for text in cli_generate(a.run, a.prompt, a.max_new_tokens, a.temperature, a.seed):
        print(text)
    return 0


def _train(argv) -> int:
    from mode.train import main

    return main(argv)


def _compare(argv) -> int:
    from mode.compare import main

    return main(argv)


def _analyze(argv) -> int:
    from analysis.report import main

    return main(argv) or 0


def _eval(argv) -> int:
    from mode.harness import main

    return main(argv)


def _export(argv) -> int:
    from mode.export import main

    return main(argv)


COMMANDS = {"train": _train, "compare": _compare, "generate": _generate, "flops": _flops, "analyze": _analyze,
            "eval": _eval, "export": _export}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: mode {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    from mode.config import ConfigError

    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
