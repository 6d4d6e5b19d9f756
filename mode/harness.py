"""`mode eval`: a `mode` run (or export) under EleutherAI's lm-evaluation-harness.

Shape legend: B rows of a scoring batch, S window length, V vocabulary, N tokens scored in a row.

`ModeLM` is an `lm_eval.api.model.LM` registered as `mode`, so the harness's own Python API works
too: `import mode.harness; lm_eval.simple_evaluate(model="mode", model_args="run=runs/tiny/mod", ...)`.

Scoring conventions (one place, `Scorer`, touches the model, so a reworked sampler or routing
API is re-pointed there):
- every text is preceded by the tokenizer's EOS, as training packs documents after an EOS;
- the tokens to score are cut into consecutive runs of at most `model.max_seq_len` tokens; each
  run is predicted by one forward over the max_seq_len tokens right before its end (fewer at the
  start of the text), so every token is scored exactly once, with as much context as fits;
- `loglikelihood(context, continuation)`: log P(continuation | EOS + context) (a long context is
  cut from the left; a continuation longer than max_seq_len spans several windows);
- `loglikelihood_rolling(doc)`: log P(doc | EOS), windows over the whole document;
- routing `causal` (default) decides each token from itself and earlier tokens, so no scored
  token looks ahead; `topk` is the training-time routing, which sees the whole window (labelled
  in the results). Rows are batched (right-padded) only when they cannot affect each other:
  causal routing and no capacity-limited expert layer (a shared expert capacity or a top-k over
  the sequence couples the tokens of a forward pass).
- `generate_until` samples with `mode.generate.generate_ids` (KV cache, causal routing), which
  ends each row as soon as its text holds one of its stop sequences; the text is cut before it.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from mode.config import ConfigError, refuse_blank
from mode.generate import rows_independent

INSTALL_HINT = "mode eval needs lm-evaluation-harness: pip install -e '.[eval]'  (or: pip install lm-eval)"


# ----------------------------------------------------------------------------------------------
# Windows and scoring: plain functions of token ids (no lm-eval needed).


def windows(stream: list[int], start: int, max_len: int) -> list[tuple[list[int], int]]:
    """Score the targets stream[start:] (start >= 1) each exactly once: (input ids, n) per window,
    whose last n inputs are followed by the next n targets. A window ends at the next at most
    max_len targets and holds the max_len tokens before them (fewer only at the stream's start)."""
    out, p = [], start
    while p < len(stream):
        end = min(p + max_len, len(stream))  # targets stream[p:end], inputs end at stream[end - 2]
        out.append((stream[max(0, end - 1 - max_len) : end - 1], end - p))
        p = end
    return out


# A generate_until request's generation_kwargs read by Scorer.generate_until -> mode.generate.SAMPLING's rule of each.
GEN_KWARGS = {"max_gen_toks": "max_new_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
              "until": "stop", "seed": "seed"}
IMPLEMENTED = (*GEN_KWARGS, "do_sample")  # do_sample: lm-eval's switch between greedy and temperature


def check_gen_kwargs(kw, where: str = "") -> list[str]:
    """A task's generation_kwargs by `mode generate`'s rules for the same values, do_sample true or
    false; null until/top_k/top_p/seed/do_sample mean the default, an empty `until` string (bare or
    in a list) is no stop sequence, as in lm-eval. ConfigError (`where` prefixes the key) before
    anything is generated: a bad value was a ValueError mid-evaluation, or silently changed (top_p
    0 -> 1, temperature nan -> greedy). Returns the keys mode does not implement (num_beams, ...):
    not refused, since standard tasks carry harmless extras, but the caller says they are ignored."""
    from mode.generate import check_sampling

    if not isinstance(kw, dict):
        raise ConfigError(f"{where}generation_kwargs", kw, "a mapping")
    if kw.get("do_sample") is not None and not isinstance(kw["do_sample"], bool):
        raise ConfigError(f"{where}generation_kwargs.do_sample", kw["do_sample"], "true or false")
    values = []
    for k, rule in GEN_KWARGS.items():
        v = kw.get(k)
        if k not in kw or (v is None and k in ("until", "top_k", "top_p", "seed")):
            continue
        if k == "until" and isinstance(v, (str, list)):
            v = [x for x in ([v] if isinstance(v, str) else v) if x != ""]
        values.append((f"{where}generation_kwargs.{k}", rule, v))
    check_sampling(values)
    return [str(k) for k in kw if k not in IMPLEMENTED]


def ignored_gen_kwargs_line(task: str, ignored: list[str]) -> str:
    """The warning for a task whose generation_kwargs ask for what mode does not do (a beam search
    would be scored greedy without it)."""
    return (f"warning: task {task}: generation_kwargs {', '.join(ignored)} ignored "
            f"(mode implements {', '.join(IMPLEMENTED)})")


class Scorer:
    """Log-probabilities of target tokens under a `mode` LM: the adapter between the harness and
    the model's forward (`model(ids_BS, routing=...)`)."""

    def __init__(self, model, tokenizer, routing: str = "causal", batch_size: int = 1, seed: int = 0):
        if routing not in ("causal", "topk"):
            raise ConfigError("--routing", routing, "causal or topk")
        self.model, self.tok, self.routing, self.seed = model.eval(), tokenizer, routing, int(seed)
        self.batch_size = max(1, int(batch_size)) if rows_independent(model, routing) else 1
        # Generation always routes causally, whatever --routing scores with.
        self.gen_batch_size = max(1, int(batch_size)) if rows_independent(model, "causal") else 1
        self.max_len = model.cfg.max_seq_len
        self.device = next(model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode(text)]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and of the continuation as they are tokenized together;
        trailing spaces of the context move to the continuation (the harness's convention)."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        ctx = self.encode(context)
        whole = self.encode(context + continuation)
        return (ctx, whole[len(ctx):]) if whole[: len(ctx)] == ctx else (ctx, self.encode(continuation))

    @torch.no_grad()
    def logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[torch.Tensor, bool]]:
        """rows: (input ids [S], target ids [N <= S]) where targets are the next tokens after the
        LAST N inputs. Returns per row the float64 log-probs [N] and whether all N are greedy."""
        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            S = len(rows[idx[0]][0])
            ids_BS = torch.full((len(idx), S), self.tok.eos_id, dtype=torch.long)
            for r, i in enumerate(idx):
                ids_BS[r, : len(rows[i][0])] = torch.tensor(rows[i][0], dtype=torch.long)
            logits_BSV = self.model(ids_BS.to(self.device), routing=self.routing).logits
            for r, i in enumerate(idx):
                inp, tgt = rows[i]
                logits_NV = logits_BSV[r, len(inp) - len(tgt) : len(inp)].double().cpu()
                tgt_N = torch.tensor(tgt, dtype=torch.long)
                lp_N = logits_NV.log_softmax(-1).gather(1, tgt_N[:, None])[:, 0]
                out[i] = (lp_N, bool((logits_NV.argmax(-1) == tgt_N).all()))
        return out

    # The three request types, on plain strings.

    def _score_streams(self, streams: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(sum of log-probs, all greedy) of stream[start:] for each (stream, start), in windows."""
        rows, owner = [], []
        for k, (stream, start) in enumerate(streams):
            p = start
            for inp, n in windows(stream, start, self.max_len):
                rows.append((inp, stream[p : p + n]))
                owner.append(k)
                p += n
        totals = [[0.0, True] for _ in streams]
        for k, (lp, greedy) in zip(owner, self.logprobs(rows)):
            totals[k][0] += float(lp.sum())
            totals[k][1] &= greedy
        return [(ll, greedy) for ll, greedy in totals]

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """log P(continuation | EOS + context); a continuation longer than max_seq_len is scored
        in windows like a rolling document."""
        streams = []
        for context, continuation in pairs:
            ctx, cont = self.encode_pair(context, continuation)
            streams.append(([self.tok.eos_id] + ctx + cont, 1 + len(ctx)))
        return self._score_streams(streams)

    def loglikelihood_rolling(self, docs: list[str]) -> list[float]:
        return [ll for ll, _ in self._score_streams([([self.tok.eos_id] + self.encode(d), 1) for d in docs])]

    def generate_until(self, requests: list[tuple[str, dict]]) -> list[str]:
        """Each request (context, gen_kwargs) sampled after EOS + context (cut from the left to fit
        max_gen_toks), stopping as soon as the text holds a string of its `until`, cut before it.
        Greedy requests with the same max_gen_toks share a batch (largest first) when rows cannot
        affect each other at sampling time. A sampled request (do_sample with temperature > 0; its
        top_k and top_p apply) runs alone with its own seed: the task's `seed` (else the scorer's)
        plus its index, so lm-eval's `repeats` copies of a request draw different samples, and the
        same request list draws the same ones again."""
        from mode.generate import cut_at_stop, generate_ids

        for _, kw in requests:  # `mode eval` checked its tasks' at load; lm-eval's Python API may pass others
            check_gen_kwargs(kw)
        groups: dict[tuple, list] = {}
        for i, (context, kw) in enumerate(requests):
            until = kw.get("until") or []
            until = [s for s in ([until] if isinstance(until, str) else until) if s]
            n = max(1, min(int(kw.get("max_gen_toks", 256)), self.max_len))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
            prompt = ([self.tok.eos_id] + self.encode(context))[-(self.max_len + 1 - n):]
            sampled = temperature > 0  # a sampled request alone: its seed, not its batch, fixes its draws
            # a null seed is the default (the scorer's); modulo 2**64, torch.Generator's seeds (it
            # reads s and s + 2**64 alike), so the largest seed check_gen_kwargs allows plus i still seeds
            seed = self.seed if kw.get("seed") is None else int(kw["seed"])
            key = (n, temperature, int(kw.get("top_k") or 0), float(kw.get("top_p") or 1.0),
                   (seed + i) % 2**64, i) if sampled else (n, 0.0, 0, 1.0, 0, -1)
            groups.setdefault(key, []).append((i, prompt, until))
        outs: list = [None] * len(requests)
        for (n, temperature, top_k, top_p, seed, _), rows in groups.items():
            rows.sort(key=lambda r: -len(r[1]))  # similar prompt lengths share a prefill
            for b in range(0, len(rows), self.gen_batch_size):
                chunk = rows[b : b + self.gen_batch_size]
                new = generate_ids(self.model, [p for _, p, _ in chunk], n, temperature=temperature, seed=seed,
                                   top_k=top_k, top_p=top_p,
                                   eos_id=self.tok.eos_id, vocab_limit=min(self.tok.vocab_size, self.model.cfg.vocab_size),
                                   stop=[u for _, _, u in chunk], decode=self.tok.decode)
                for (i, _, until), ids in zip(chunk, new):
                    outs[i] = cut_at_stop(self.tok.decode(ids), until)
        return outs


# ----------------------------------------------------------------------------------------------
# The lm-eval model class, registered as `mode`.


def _define_lm_class():
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    @register_model("mode")
    class ModeLM(LM):
        """A `mode` run directory or `mode export` directory as an lm-eval model.
        model_args: run=DIR, routing=causal|topk, batch_size=B, device=cpu|cuda, seed=N (of sampled
        generation requests; request i draws with seed N + i)."""

        def __init__(self, run: str | None = None, routing: str = "causal", batch_size=1, device=None,
                     model=None, tokenizer=None, seed=0, max_batch_size=None, **unknown):
            super().__init__()
            if unknown:  # a misspelt key (`rouitng=topk`) was ignored: scored with the defaults, silently
                raise ConfigError("model_args", ",".join(f"{k}={v}" for k, v in unknown.items()),
                                  "keys of run, routing, batch_size, device, seed (lm-eval's max_batch_size: unused)")
            if model is None:
                from mode.generate import load_run

                if run is None:
                    raise ValueError("model_args needs run=RUN_DIR (a run or `mode export` directory)")
                device = device or ("cuda" if torch.cuda.is_available() else "cpu")
                model, tokenizer, _, self.source = load_run(run, device, return_source=True)
            else:
                self.source = None
            bs = 1 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
            self.scorer = Scorer(model, tokenizer, routing, bs, seed=int(seed))
            self.run, self.routing = run, routing

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood([tuple(r.args[:2]) for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self.scorer.generate_until([(r.args[0], dict(r.args[1])) for r in requests])

    return ModeLM


try:
    ModeLM = _define_lm_class()
except ImportError:  # lm-eval is an optional extra; `mode eval` says how to install it
    ModeLM = None


# ----------------------------------------------------------------------------------------------
# `mode eval`


@contextmanager
def _hub(offline: bool):
    """datasets and huggingface_hub read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, at import: an
    offline block sets their flags (local files and the local HF cache only: no request, so no
    retries). Their warnings are held back either way (a failed download is retried with a log
    line per try, ~50 s of them; the failure becomes one line here), and so is lm-eval's note on
    every `custom_dataset` task (the shipped example reads its data through one)."""
    import logging

    import datasets.config
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE
    # CRITICAL: datasets logs a parse error at ERROR before raising it; the exception becomes the line
    loggers = [logging.getLogger(n) for n in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    task_log = logging.getLogger("lm_eval.api.task")
    custom_note = lambda r: "Custom kwargs can be passed" not in r.getMessage()  # noqa: E731
    try:
        if offline:
            datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        task_log.addFilter(custom_note)
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        task_log.removeFilter(custom_note)


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when the Hugging Face Hub answers (any HTTP status; HF_ENDPOINT and proxy settings
    honoured, as huggingface_hub's own session does), else why not."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - DNS, refused, timeout, proxy: all mean "not reachable"
        return f"{constants.ENDPOINT}: {' '.join(str(e).split()) or type(e).__name__}"
    return None


def _task_manager(tasks: list[str], include_path: str | None):
    """(TaskManager that knows every requested task, offline): unknown names and tasks whose data
    cannot be loaded are one-line errors before any scoring (and before anything is written).
    Indexing the harness's ~15k built-in task YAMLs takes ~25 s, so when --include-path alone
    defines all requested tasks the built-ins are not indexed. Data are read offline first (local
    files, the local HF cache); only a task missing from both asks the hub, once reachable:
    `offline` says whether scoring can stay offline too."""
    import datasets
    import datasets.config
    from huggingface_hub import constants
    from lm_eval.tasks import TaskManager

    datasets.disable_progress_bars()
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError("--include-path", include_path, "an existing directory of task YAML files")
    tm = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if tm is None or not set(tasks) <= set(tm.all_tasks):
        tm = TaskManager(include_path=include_path)
    for t in tasks:
        if t not in tm.all_tasks:
            where = f" or under {include_path}" if include_path else " (add --include-path DIR for local task YAMLs)"
            raise ConfigError("--tasks", t, f"a task, group or tag known to lm-eval{where}; `lm-eval ls tasks` lists them")
    env_offline = datasets.config.HF_HUB_OFFLINE  # HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set
    offline = True
    for t in tasks:
        while True:
            try:
                with _hub(offline):
                    loaded = tm.load([t])
                break
            except ConnectionError as e:  # offline: not in the cache (datasets' and the hub's errors alike)
                if not offline:
                    _data_error(t, e, include_path)
                why = "offline mode: HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if env_offline else _hub_unreachable()
                if why is None:
                    offline = False  # the hub answers: download (and score) online
                    continue
                raise ConfigError("--tasks", msg=(
                    f"--tasks={t!r}: its data is neither in the local Hugging Face cache ({constants.HF_HOME}) nor "
                    f"reachable ({why}); download it once on a machine with network into a cache HF_HOME points to "
                    "(README: standard tasks), or use a local task YAML (--include-path)")) from None
            except Exception as e:  # datasets raises many kinds: missing file, bad schema
                _data_error(t, e, include_path)
        for name, task in loaded["tasks"].items():  # before anything is evaluated, not mid-evaluation
            if task.get_config("output_type") == "generate_until":
                ignored = check_gen_kwargs(task.get_config("generation_kwargs"), f"task {name}: ")
                if ignored:
                    print(ignored_gen_kwargs_line(name, ignored), file=sys.stderr, flush=True)
    return tm, offline


def _data_error(task: str, e: Exception, include_path: str | None = None):
    root = e  # datasets wraps a parser's message ("Missing a comma ...") in a generic one: show the cause
    for _ in range(8):
        inner = root.__cause__ or (root.__context__ if "error occurred" in str(root) else None)
        if inner is None:
            break
        root = inner
    msg = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    missing = re.search(r"'(/[^']*)'", msg)
    tasks_dir = f"{Path(include_path).resolve()}{os.sep}" if include_path else None
    if isinstance(e, FileNotFoundError) and (missing is None or missing[1].startswith(f"{Path.cwd()}{os.sep}")
                                             and not (tasks_dir and missing[1].startswith(tasks_dir))):
        # datasets reads a `dataset_path: json` task's relative data_files from the cwd (a file missing
        # beside the task YAMLs is missing where a `custom_dataset` loader such as local_json looks)
        msg += (f"; relative data paths are read from the current directory {Path.cwd()}: run from the directory they "
                "are relative to, write absolute paths, or read them relative to the YAML as configs/eval does "
                "(custom_dataset: !function local_json.load)")
    raise ConfigError("--tasks", msg=f"--tasks={task!r}: its data could not be loaded ({type(e).__name__}: {msg})") from None


def evaluate(run: str, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             batch_size: int = 1, routing: str = "causal", device: str | None = None, lm=None) -> dict:
    """lm-eval's `simple_evaluate` over a `mode` run; returns its results dict with a `mode` entry
    (run, routing) added."""
    import lm_eval

    if routing not in ("causal", "topk"):
        raise ConfigError("--routing", routing, "causal or topk")
    if lm is None:  # first: a wrong --run (the usual mistake) is found before lm-eval indexes its tasks (~25 s)
        lm = ModeLM(run=run, routing=routing, batch_size=batch_size, device=device)
    tm, offline = _task_manager(tasks, include_path)
    with _hub(offline):  # the harness loads the tasks again: from where they were found above
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit, batch_size=batch_size,
                                      log_samples=False)
    source = getattr(lm, "source", None)  # the weights scored: a run that trains on leaves no doubt
    model = getattr(getattr(lm, "scorer", None), "model", None)
    res["mode"] = {"written_by": WRITTEN_BY, "run": str(run), "routing": routing,
                   "weights": str(source) if source is not None else None, **scoring_note(model, routing)}
    return res


def scoring_note(model, routing: str) -> dict:
    """What the scores mean (`note`), and whether they are sampling-safe: no token's result depends on
    later tokens (`sampling_safe`; None for a model this cannot inspect)."""
    if routing != "causal":
        return {"note": "topk: training-time routing (sees the whole window: not sampling-safe)", "sampling_safe": False}
    if model is None or rows_independent(model, routing):
        return {"note": "causal: sampling-time routing (no lookahead)", "sampling_safe": None if model is None else True}
    return {"note": "causal routing, but expert capacity is shared by the window (model.moe."
                    f"inference_capacity_factor={model.cfg.moe.inference_capacity_factor}): a token's experts depend "
                    "on later tokens (lookahead; not sampling-safe)", "sampling_safe": False}


WRITTEN_BY = "mode eval"  # in every results file's `mode` entry: proves mode eval wrote it (a rerun may replace it)


def written_by_mode_eval(path: Path) -> bool:
    """Is this file a results JSON `mode eval` wrote? Its `mode` entry says so (written_by), or, in
    files written before that key existed, is exactly the entry evaluate() added then."""
    try:
        res = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    m = res.get("mode") if isinstance(res, dict) else None
    if not isinstance(m, dict) or "results" not in res:
        return False
    return m.get("written_by") == WRITTEN_BY or (set(m) == {"run", "routing", "note"}
                                                 and m["routing"] in ("causal", "topk"))


def check_out(out: Path, key: str, shown: str, explicit: bool) -> None:
    """Before anything is evaluated (ConfigError, one line): `out` must be a file path in a writable
    place; an existing explicit --out only a results file mode eval wrote (never a user's file)."""
    if out.is_dir():
        raise ConfigError(key, shown, "a file path, not a directory")
    if out.exists() and not written_by_mode_eval(out):  # the default path too: a user's file may sit there
        raise ConfigError(key, shown, "a new file or a results file mode eval wrote (this file is not one: "
                                      "mode eval will not overwrite it" + ("" if explicit else "; pass --out") + ")")
    place = out.parent
    while not place.exists() and place != place.parent:  # the default RUN/eval/ is created
        place = place.parent
    if not place.is_dir():
        raise ConfigError(key, shown, f"a file in a directory ({place} is a file)")
    try:  # a real write, not os.access: root passes that everywhere, and /sys or /proc refuse files anyway
        fd, probe = tempfile.mkstemp(dir=place, prefix=".mode-eval-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(key, shown, f"a writable location ({place}: {e.strerror}): checked before evaluating, "
                                      "so no results are lost") from None


def default_out_name(tasks: list[str], routing: str, limit: float | None = None) -> str:
    """results_<tasks>_<routing>.json (`_limit<N>` before .json with --limit: a smoke test's few
    examples never replace a full evaluation's results); many tasks: the first, their count and a
    hash of all, so the name stays within a filesystem's 255 bytes."""
    joined = "+".join(tasks)
    if len(joined.encode()) > 160:
        import hashlib

        joined = f"{tasks[0][:60]}+{len(tasks) - 1}more-{hashlib.sha256(joined.encode()).hexdigest()[:10]}"
    return f"results_{joined}_{routing}" + ("" if limit is None else f"_limit{limit_name(limit)}") + ".json"


def limit_name(limit: float) -> str:
    """--limit in a results name, exactly: a count in full, a fraction by its shortest repr (`:g` kept
    6 digits, so --limit 1234567 and 1234568 wrote one file, the second replacing the first)."""
    return str(int(limit)) if limit >= 1 else repr(float(limit))


def format_table(res: dict) -> str:
    lines = [f"routing={res['mode']['routing']}  run={res['mode']['run']}", "| task | metric | value | stderr |",
             "| --- | --- | --- | --- |"]
    if res["mode"]["routing"] == "causal" and res["mode"].get("sampling_safe") is False:  # "causal" would mislead
        lines.insert(1, f"warning: {res['mode']['note']}")
    for task, metrics in res["results"].items():
        for k, v in metrics.items():
            if k in ("alias", "sample_len") or "_stderr" in k or not isinstance(v, (int, float)):
                continue
            name, _, filt = k.partition(",")
            se = metrics.get(f"{name}_stderr,{filt}")
            se = f"{se:.4g}" if isinstance(se, (int, float)) else ""
            lines.append(f"| {task} | {name} | {v:.6g} | {se} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from mode.errors import OneLineParser  # bad options: one line, exit 2
    from mode.compare import check_outside_grids
    from mode.rundir import check_outside_runs

    p = OneLineParser(prog="mode eval", description="Evaluate a run with lm-evaluation-harness.")
    p.add_argument("--run", required=True, help="run directory or `mode export` directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task/group names")
    p.add_argument("--include-path", help="directory of extra task YAMLs (e.g. configs/eval)")
    p.add_argument("--limit", type=float, help="at most N examples per task (a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    p.add_argument("--routing", default="causal", help="causal (sampling-time, default) or topk (training-time)")
    p.add_argument("--out", help="results JSON file (default: RUN/eval/results_<tasks>_<routing>.json, "
                                 "..._limit<N>.json with --limit)")
    a = p.parse_args(argv)
    if ModeLM is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks", a.tasks, "one or more comma-separated task names")
    refuse_blank("--include-path", a.include_path)  # was taken as none: a local task "unknown"
    if a.batch_size < 1:
        raise ConfigError("--batch-size", a.batch_size, ">= 1")
    if a.limit is not None and (not math.isfinite(a.limit) or a.limit <= 0 or (a.limit > 1 and a.limit % 1)
                                or a.limit > sys.maxsize):
        raise ConfigError("--limit", a.limit, f"a finite number > 0: a whole count up to {sys.maxsize}, or a "
                          "fraction if < 1")
    if a.routing not in ("causal", "topk"):
        raise ConfigError("--routing", a.routing, "causal or topk")
    refuse_blank("--out", a.out)  # was taken as no --out: the results went to the default file
    if a.out and a.out.endswith(("/", os.sep)):  # Path() drops the slash: `--out results/` wrote a file `results`
        raise ConfigError("--out", a.out, "a file path, not a directory (it ends in /)")
    out = Path(a.out) if a.out else Path(a.run) / "eval" / default_out_name(tasks, a.routing, a.limit)
    own_eval = out.parent.resolve() == (Path(a.run) / "eval").resolve() and Path(a.run).is_dir()  # made if missing
    if a.out and not own_eval and not out.parent.is_dir():
        why = "is a file" if out.parent.exists() else "does not exist"
        raise ConfigError("--out", a.out, f"a file in an existing directory ({out.parent} {why})")
    if a.out:  # the default, RUN/eval/, is the run's own
        check_outside_runs(a.out, "--out", owned="eval")
        check_outside_grids(a.out, "--out")
    check_out(out, "--out", a.out if a.out else str(out), explicit=bool(a.out))
    limit = int(a.limit) if a.limit is not None and a.limit >= 1 else a.limit
    res = evaluate(a.run, tasks, a.include_path, limit, a.batch_size, a.routing)
    print(format_table(res))
    write_results(out, res)
    print(f"results: {out}")
    return 0


def write_results(out: Path, res: dict) -> None:
    """Whole or not at all (a reader never sees half a file); a failed write (a full disk: the check
    before evaluating wrote an empty file) leaves no temporary file and names the results file."""
    from mode.rundir import write_atomic

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(res, indent=2, default=str) + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out)) from e
