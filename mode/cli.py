"""`mode train | compare | generate | flops | analyze | data prepare | eval | export`.

Config errors print one `config error:` line and exit 2 before any worker process starts; runtime
faults print one `error:` line naming the cause (exit 1). `--debug` shows tracebacks instead.
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
        _check_knob(cfg, a.knob)
        from mode.flops import solve_knob

        target = count(load_config(a.match))["forward_flops_per_token"]
        v = solve_knob(cfg, a.knob, target, 1e-3, 1.0)
        print(f"{a.knob}={v:.6g}  (target {target:.6g} FLOPs/token)")
        cfg = load_config(a.config, a.overrides + [f"{a.knob}={v}"])
    c = count(cfg)
    print(json.dumps(c) if a.json else format_table(c))
    return 0


def _check_knob(cfg, knob: str) -> None:
    from mode.config import ConfigError

    import dataclasses
    import typing

    *path, last = knob.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part, None)
    tp = typing.get_type_hints(type(node)).get(last) if dataclasses.is_dataclass(node) else None
    if tp not in (float, typing.Optional[float]):
        raise ConfigError("--knob", knob, "a float field of the config (e.g. model.mod.capacity, "
                          "model.moe.capacity_factor)")


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


def _data(argv) -> int:
    if not argv or argv[0] != "prepare":
        print("usage: mode data prepare --config F [--force] [dotted.key=value ...]", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="mode data prepare", description="Tokenize the configured corpus once into "
                                "memory-mapped shards under data.prepared_dir (training then only reads them).")
    p.add_argument("--config", required=True)
    p.add_argument("--force", action="store_true", help="rebuild a stale prepared directory (only that one)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    a = p.parse_args(argv[1:])
    from mode.config import load_config
    from mode.data import check_data
    from mode.prepare import prepare, read_manifest

    cfg = load_config(a.config, a.overrides)
    path = prepare(cfg.data, force=a.force, progress=cfg.log.progress)
    check_data(cfg)  # the config that prepared it can also train on it
    m = read_manifest(path)
    sp = m["splits"]
    print(f"prepared {path}: train {sp['train']['tokens']:,} tokens / {sp['train']['documents']:,} documents, "
          f"val {sp['val']['tokens']:,} tokens / {sp['val']['documents']:,} documents "
          f"({m['dtype']}, vocab {m['vocab_size']}, EOS {m['eos_id']}; {m['tokens_per_s']:,} tokens/s)")
    return 0


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
            "data": _data, "eval": _eval, "export": _export}


def main(argv=None) -> int:
    from mode.errors import guarded, wants_debug

    debug, argv = wants_debug(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: mode {{{','.join(COMMANDS)}}} [--debug] ...", file=sys.stderr)
        return 2
    if debug:
        import os

        os.environ["MODE_DEBUG"] = "1"  # child processes (launcher ranks) show tracebacks too
    return guarded(COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
