"""`mode train | compare | generate | flops | analyze | data prepare | eval | export`.

Config errors print one `config error:` line and exit 2 before any worker process starts; runtime
faults print one `error:` line naming the cause (exit 1). `--debug` shows tracebacks instead.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mode.errors import Once
from mode.errors import OneLineParser as _OneLineParser  # bad options: one line, exit 2


def _flops(argv) -> int:
    from mode.config import ConfigError, load_config
    from mode.flops import count, format_table

    p = _OneLineParser(prog="mode flops", description="Parameters and forward FLOPs per token.")
    p.add_argument("--config", required=True, action=Once)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--match", metavar="OTHER.yaml", help="solve --knob so FLOPs/token equal OTHER's")
    p.add_argument("--knob", help="float field tuned by --match (default: model.mod.capacity)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of --config (not of "
                   "--match's OTHER.yaml, which is read as written; mode compare applies its overrides to every variant)")
    a = p.parse_intermixed_args(argv)  # overrides before or after the options, as in `mode train`
    if a.knob is not None and not a.match:  # it only says what --match tunes: alone it did nothing, silently
        raise ConfigError("--knob", a.knob, "given with --match OTHER.yaml (the field --match tunes)")
    typed_knob, a.knob = a.knob is not None, a.knob or "model.mod.capacity"
    cfg = load_config(a.config, a.overrides)
    if a.match:
        _check_knob(cfg, a.knob)
        from mode.flops import solve_knob

        if not Path(a.match).is_file():
            raise ConfigError("--match", a.match, "an existing YAML file")
        target = count(load_config(a.match))["forward_flops_per_token"]
        ends = [count(load_config(a.config, a.overrides + [f"{a.knob}={x}"]))["forward_flops_per_token"]
                for x in (1e-3, 1.0)]
        if ends[0] == ends[1]:  # e.g. model.mod.capacity of a config without depth-routed layers
            raise ConfigError("--knob", a.knob, f"a field that changes this config's FLOPs/token ({ends[0]:.6g} at "
                              "0.001 and at 1 here)" + ("" if typed_knob else "; --knob (default model.mod.capacity) "
                                                        "names the field --match tunes, e.g. model.moe.capacity_factor"))
        v = solve_knob(cfg, a.knob, target, 1e-3, 1.0)
        cfg = load_config(a.config, a.overrides + [f"{a.knob}={v}"])
        got = count(cfg)["forward_flops_per_token"]
        if abs(got / target - 1) > 0.02:  # the knob cannot go that far
            raise ConfigError("--match", a.match, msg=f"--match={a.match}: its {target:.6g} FLOPs/token is out of "
                              f"reach of {a.knob} in [0.001, 1], which gives {ends[0]:.6g} to {ends[1]:.6g} here "
                              "(2% allowed, as match_flops)")
        solved = {"knob": a.knob, "value": v, "target_flops_per_token": target}
    c = count(cfg)
    if a.json:  # stdout holds one JSON object: the solved knob goes into it
        print(json.dumps({**c, "match": solved} if a.match else c))
    else:
        if a.match:
            print(f"{a.knob}={v:.6g}  (target {target:.6g} FLOPs/token)")
        print(format_table(c))
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
    if tp is not float and float not in typing.get_args(tp):  # float, Optional[float], Capacity (float or list)
        import difflib

        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = difflib.get_close_matches(last, names, n=1) if tp is None else []
        hint = f"; did you mean {'.'.join(path)}.{close[0]}?" if close else ""
        raise ConfigError("--knob", knob, "a float field of the config (e.g. model.mod.capacity, "
                          f"model.moe.capacity_factor){hint}")
    value = getattr(node, last)
    if isinstance(value, list):  # a per-layer schedule: one solved value would replace it silently
        raise ConfigError("--knob", knob, f"a field holding one value (this config gives a per-layer list, {value}: "
                          "--match solves one value for every layer; set it to one value to solve it)")


def _generate(argv) -> int:
    from mode.config import ConfigError, refuse_blank
    from mode.generate import check_sampling, cli_generate

    p = _OneLineParser(prog="mode generate", description="Sample from a trained run (KV cache, prefill, causal "
                       "routing: a prompt's logits and greedy output do not depend on the other prompts of the batch).")
    p.add_argument("--run", required=True, help="run directory (config.yaml, checkpoints/) or `mode export` directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch of prompts")
    p.add_argument("--prompt-file", help="a text file with one prompt per line (added after any --prompt); "
                   "blank lines are skipped")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample after each prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="default 0.8 (sampled); 0 = greedy (argmax; --top-k/--top-p unused)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set holding this mass; 1 = all")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="a row stops as soon as its text holds this string, cut before it (repeatable); "
                        "a row also stops at EOS")
    p.add_argument("--seed", type=int, default=0, help="of the sampling draws (default 0)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt and line: prompt, completion, num_tokens")
    a = p.parse_args(argv)
    check_sampling([("--max-new-tokens", "max_new_tokens", a.max_new_tokens),
                    ("--temperature", "temperature", a.temperature), ("--top-k", "top_k", a.top_k),
                    ("--top-p", "top_p", a.top_p), ("--stop", "stop", a.stop), ("--seed", "seed", a.seed)])
    for key, values in (("--prompt", a.prompt), ("--stop", a.stop)):
        for v in values:  # bytes the shell passed that are not UTF-8 (a Latin-1 terminal): lone surrogates here
            if not v.isascii() and any("\udc80" <= ch <= "\udcff" for ch in v):
                raise ConfigError(key, v, "UTF-8 text (the shell passed bytes that are not UTF-8)")
    refuse_blank("--prompt-file", a.prompt_file)  # was skipped: the --prompts ran without its file
    prompts = list(a.prompt)
    if a.prompt_file:
        f = Path(a.prompt_file)
        if not f.is_file():
            raise ConfigError("--prompt-file", a.prompt_file, "an existing text file, one prompt per line")
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError("--prompt-file", a.prompt_file, f"a UTF-8 text file, one prompt per line (byte "
                              f"{e.start} is not UTF-8)") from None
        # lines end at "\n" only (str.splitlines also splits at form feeds and other separators that
        # a prompt may hold); a blank line is no prompt
        prompts += [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        if a.prompt_file:  # the file was given and holds no prompt: name it
            raise ConfigError("--prompt-file", a.prompt_file, "a file with at least one non-blank line (one prompt "
                              "per line; this one has none)")
        raise ConfigError("--prompt", msg="--prompt: none given; at least one --prompt or a non-empty --prompt-file")
    try:
        outs = cli_generate(a.run, prompts, a.max_new_tokens, a.temperature, a.seed, a.top_k, a.top_p, a.stop,
                            completions=True)
    except FileNotFoundError as e:  # no run directory / no complete checkpoint
        raise ConfigError("--run", a.run, msg=None, allowed=str(e)) from None
    for i, c in enumerate(outs):
        if a.json:
            print(json.dumps({"prompt": c.prompt, "completion": c.completion, "num_tokens": c.num_tokens}))
        else:  # a header line per prompt: completions may span lines
            print(f"=== [{i}] {c.num_tokens} tokens ===\n{c.prompt}{c.completion}")
    return 0


def _train(argv) -> int:
    from mode.train import main

    return main(argv)


def _compare(argv) -> int:
    from mode.compare import main

    return main(argv)


def _data(argv) -> int:
    if not argv or argv[0] != "prepare":
        helps = bool(argv) and argv[0] in ("-h", "--help")
        usage = "usage: mode data prepare --config F [--force] [dotted.key=value ...]"
        if argv and not helps:  # name what was typed: `mode data prepar`, or `prepare` left out
            usage = f"mode data: error: unknown subcommand {argv[0]!r} (one of prepare); {usage}"
        print(usage, file=sys.stdout if helps else sys.stderr)
        return 0 if helps else 2
    p = _OneLineParser(prog="mode data prepare", description="Tokenize the configured corpus once into "
                                "memory-mapped shards under data.prepared_dir (training then only reads them).")
    p.add_argument("--config", required=True, action=Once)
    p.add_argument("--force", action="store_true", help="rebuild the prepared directory, stale or not (only that one)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    a = p.parse_intermixed_args(argv[1:])  # overrides before or after the options, as in `mode train`
    from mode.config import load_config
    from mode.data import check_data, check_vocab
    from mode.prepare import MANIFEST, prepare, prepared_path, read_manifest

    cfg = load_config(a.config, a.overrides)
    check_vocab(cfg)  # before hours of tokenizing, as `mode train` does

    def manifest_id():
        try:
            st = (prepared_path(cfg.data) / MANIFEST).stat()
            return st.st_ino, st.st_mtime_ns
        except OSError:
            return None

    before = manifest_id()
    path = prepare(cfg.data, force=a.force, progress=cfg.log.progress)
    check_data(cfg)  # the config that prepared it can also train on it
    m = read_manifest(path)
    sp = m["splits"]
    done = "already prepared" if before is not None and manifest_id() == before else "prepared"
    print(f"{done} {path}: train {sp['train']['tokens']:,} tokens / {sp['train']['documents']:,} documents, "
          f"val {sp['val']['tokens']:,} tokens / {sp['val']['documents']:,} documents "
          f"({m['dtype']}, vocab {m['vocab_size']}, EOS {m['eos_id']}; {m['tokens_per_s']:,} tokens/s "
          f"over {'the resumed part of the' if m.get('resumed') else 'the whole'} prepare"
          f"{', when it was made' if done != 'prepared' else ''})")
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


SUMMARIES = {  # `mode --help`: one line per command (README "Commands" has them with their options)
    "train": "train one run (a config plus dotted.key=value overrides; resumes its run.dir)",
    "compare": "run an experiment's grid of variants x seeds and write its report",
    "generate": "sample from a run or an export (causal routing)",
    "flops": "parameters and forward FLOPs per token; --match solves a knob to another config's FLOPs",
    "analyze": "write the comparison report of a directory of runs",
    "data": "data prepare: tokenize a config's data once into memory-mapped shards",
    "eval": "evaluate a run with lm-evaluation-harness tasks",
    "export": "write a portable model (safetensors, config, tokenizer) of a run",
}


def main(argv=None) -> int:
    from mode.errors import guarded, wants_debug

    debug, argv = wants_debug(list(sys.argv[1:] if argv is None else argv))
    usage = f"usage: mode {{{','.join(COMMANDS)}}} [--debug] ...  (mode COMMAND --help for its options)"
    if argv and argv[0] in ("-h", "--help"):
        print(usage + "\n\n" + "\n".join(f"  {name:<9}{what}" for name, what in SUMMARIES.items())
              + "\n\n--debug (any command, or MODE_DEBUG=1): a traceback instead of the one-line error")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage if not argv else f"mode: error: unknown command {argv[0]!r} (one of {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    if debug:
        import os

        os.environ["MODE_DEBUG"] = "1"  # child processes (launcher ranks) show tracebacks too
    return guarded(COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
