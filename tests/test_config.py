"""Config schema, inheritance, overrides and one-line errors (before any worker starts)."""

import pytest

from mode.config import ConfigError, load_config, markdown_reference, parse_yaml
from tests.util import ROOT, mode_cli, mode_here


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")
                                        if not {"experiments", "eval"} & set(p.parts)))  # eval/: lm-eval task YAMLs
def test_every_yaml_loads(path):
    cfg = load_config(ROOT / path)
    assert cfg.model.d_model > 0


def test_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "a.yaml").write_text("model: {d_model: 64, n_heads: 2}\ntrain: {max_steps: 7}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmodel: {n_layers: 3}\n")
    cfg = load_config(tmp_path / "b.yaml", ["train.max_steps=9", "optim.lr=1e-3", "model.moe.capacity_factor=null"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads) == (64, 3, 2)
    assert cfg.train.max_steps == 9 and cfg.optim.lr == 1e-3 and cfg.model.moe.capacity_factor is None


def test_yaml_merge_keys_are_read_and_duplicates_beside_them_refused(tmp_path):
    """Bug caught: the duplicate-key loader constructed every key, and a merge key (`<<: *anchor`,
    how researchers share settings between sections) has no constructor: valid YAML was refused."""
    (tmp_path / "a.yaml").write_text("model: {d_model: 64, n_heads: 2}\ncheckpoint: &c {every: 7, keep: 3}\n"
                                     "train:\n  <<: [{max_steps: 9}, {log_every: 3}]\n  log_every: 1\n")
    cfg = load_config(tmp_path / "a.yaml")
    assert (cfg.train.max_steps, cfg.train.log_every) == (9, 1)  # a key written beside the merge wins
    assert parse_yaml("a: &c {x: 1, y: 2}\nb: {<<: *c, y: 3}\n")["b"] == {"x": 1, "y": 3}
    (tmp_path / "b.yaml").write_text("train:\n  <<: {max_steps: 9}\n  log_every: 5\n  log_every: 6\n")
    with pytest.raises(ConfigError, match="duplicate key 'log_every'"):
        load_config(tmp_path / "b.yaml")


@pytest.mark.parametrize("text", ["? [1, 2]\n: 3\n", "model:\n  ? {a: 1}\n  : 3\n"])
def test_a_list_or_mapping_as_a_yaml_key_is_a_config_error(tmp_path, text):
    """Bug caught: the duplicate-key loader put every key into a set, and a complex key (`? [1, 2]`)
    raised TypeError (exit 1, `error: TypeError: unhashable type`) instead of one config error line."""
    (tmp_path / "a.yaml").write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML .*unhashable key"):
        load_config(tmp_path / "a.yaml")


def test_missing_base_names_the_base_line(tmp_path):
    """A `base:` that does not exist is blamed on `base`, not on --config (which exists)."""
    (tmp_path / "b.yaml").write_text("base: dense.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "b.yaml")
    msg = str(e.value)
    assert msg.startswith("config error: base='dense.yaml': an existing YAML file, relative to") and str(tmp_path / "b.yaml") in msg


@pytest.mark.parametrize("override,needle", [
    ("model.d_modle=3", "did you mean model.d_model"),
    ("model.d_model=abc", "model.d_model='abc'"),
    ("model.mod.capacity=1.5", "model.mod.capacity=1.5: a fraction in (0, 1]"),
    ("deepspeed.zero_stage=3", "deepspeed.zero_stage=3"),
    ("data.source=/nonexistent/file.txt", "data.source='/nonexistent/file.txt'"),
    ("model.n_heads=5", "model.n_heads=5"),
    ("model.moe.top_k=9", "model.moe.top_k=9"),
    # each capacity key's null said "dropless"; eval's null is training's capacity_factor
    ("model.moe.capacity_factor=0", "model.moe.capacity_factor=0.0: null (dropless) or in (0, 1e6]"),
    ("model.moe.eval_capacity_factor=0", "model.moe.eval_capacity_factor=0.0: null (as capacity_factor) or in (0, 1e6]"),
    ("model.moe.inference_capacity_factor=0", "inference_capacity_factor=0.0: null (dropless) or in (0, 1e6]"),
])
def test_bad_values_name_key_value_and_allowed(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny/dense.yaml", [override])
    msg = str(e.value)
    assert msg.startswith("config error:") and needle in msg and "\n" not in msg


@pytest.mark.parametrize("value", [".nan", "[0.5, .inf]"])
def test_a_non_finite_capacity_is_refused_as_not_finite(value):
    """Bug caught (variants walkthrough): `model.mod.capacity=.nan` (a float-or-list field) was refused
    as "a value of type float or list of float", which it is; every other float field says why."""
    with pytest.raises(ConfigError, match=r"^config error: model.mod.capacity=(nan|\[0.5, inf\]): a finite number$"):
        load_config(ROOT / "configs/tiny/mod.yaml", [f"model.mod.capacity={value}"])
    with pytest.raises(ConfigError, match=r": a value of type float or list of float$"):
        load_config(ROOT / "configs/tiny/mod.yaml", ["model.mod.capacity=[[0.5]]"])


def test_integers_too_large_for_a_float_or_for_python_are_config_errors(tmp_path):
    """Bug caught: `optim.lr=<10**400>` stopped with `error: OverflowError: int too large to convert
    to float`, and an integer of over 4,300 digits (on the command line or in the YAML file) with
    `error: ValueError: Exceeds the limit ...`: exit 1, not one config error line (exit 2)."""
    with pytest.raises(ConfigError, match=r"^config error: optim.lr=1000+: a finite number$"):
        load_config(None, [f"optim.lr={10**400}"])
    with pytest.raises(ConfigError, match=r"^config error: model.mod.capacity=\[1000+\]: "):
        load_config(None, [f"model.mod.capacity=[{10**400}]"])
    with pytest.raises(ConfigError, match=r"^config error: train.max_steps='1111.*\.\.\. \(5000 characters\)': "
                                          r"a YAML value \(Exceeds the limit"):
        load_config(None, ["train.max_steps=" + "1" * 5000])
    (tmp_path / "a.yaml").write_text("optim: {lr: " + "1" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=r"a.yaml: not valid YAML \(Exceeds the limit"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.slow
def test_cli_config_error_is_one_line_exit_2(tmp_path):
    r = mode_cli("train", "--config", "configs/tiny/dense.yaml", "model.mod.capacity=0", f"run.dir={tmp_path}/r",
                 check=False)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: model.mod.capacity=0"), r.stderr
    assert not (tmp_path / "r").exists()  # nothing started


def test_output_into_a_closed_pipe_ends_quietly(capsys, monkeypatch):
    """`mode flops ... | head`: the reader leaves; no `error: BrokenPipeError` line, status 141 (SIGPIPE's)."""
    import os
    import sys

    from mode.errors import guarded

    r, w = os.pipe()
    os.close(r)  # the reader is gone: the next write raises BrokenPipeError (Python ignores SIGPIPE)
    pipe = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", pipe)

    def talkative(argv):
        for _ in range(1000):
            print("x" * 100, flush=True)
        return 0

    try:
        assert guarded(talkative, []) == 141
        pipe.write("after"), pipe.flush()  # stdout now points at devnull: the exit-time flush cannot fail
    finally:
        pipe.close()
    assert capsys.readouterr().err == ""


def test_cli_missing_config_file(capsys, monkeypatch):
    r = mode_here(capsys, monkeypatch, "train", "--config", "nope.yaml")
    assert r.returncode == 2 and r.stderr.strip().startswith("config error: --config='nope.yaml'")


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path, capsys, monkeypatch):
    r = mode_here(capsys, monkeypatch, "train", "--config", "configs/tiny/dense.yaml", "model.vocab_size=200",
                  f"run.dir={tmp_path}/r")
    assert r.returncode == 2 and "model.vocab_size=200" in r.stderr and not (tmp_path / "r").exists()


def test_print_config_resolves(capsys, monkeypatch):
    r = mode_here(capsys, monkeypatch, "train", "--config", "configs/tiny/dense.yaml", "train.max_steps=17",
                  "--print-config", "train.log_every=3")  # overrides on both sides of an option
    assert r.returncode == 0 and "d_model: 128" in r.stdout
    assert "max_steps: 17" in r.stdout and "log_every: 3" in r.stdout


def test_every_field_documented():
    md = markdown_reference()
    assert "| `model.mod.capacity` |" in md
    assert all(line.rstrip().endswith("|") and not line.rstrip().endswith("|  |")
               for line in md.splitlines() if line.startswith("| `"))


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    assert markdown_reference().strip() in readme, "regenerate: python -m mode.config --markdown"


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_peak_tflops_must_be_finite_and_non_negative_also_from_python(value):
    """YAML and overrides refuse non-finite floats while parsing; a PerfConfig built in Python is
    checked by validate() alone."""
    from mode.config import PerfConfig

    with pytest.raises(ConfigError, match=r"^config error: perf.peak_tflops=.*: a finite number >= 0"):
        PerfConfig(peak_tflops=value).validate()
    PerfConfig(peak_tflops=989.0).validate()


@pytest.mark.parametrize("override,allowed", [
    ("data.source=my corpus/trian.txt", "an existing file, directory or glob"),
    ("data.val_source=my corpus/valid.txt", "an existing file, directory or glob"),
    ("data.tokenizer=my tok/tokenizer.json", "`byte`, a local directory holding tokenizer.json"),
])
def test_a_missing_path_with_a_space_is_a_missing_path_not_a_hub_name(tmp_path, monkeypatch, override, allowed):
    """Bug caught: `dir name/file` (two parts, like `org/name`) was taken for a hub name, so a typo in a
    local path with a space was looked up on the hub and refused with huggingface_hub's
    HFValidationError text; a hub repo id has no spaces."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny/dense.yaml", [override])
    key, value = override.split("=", 1)
    assert str(e.value).startswith(f"config error: {key}={value!r}: {allowed}"), str(e.value)


def test_config_given_twice_is_refused(capsys):
    """Bug caught (fault walkthrough): `mode train --config a.yaml ... --config b.yaml` trained b
    without a word (argparse keeps the last)."""
    from mode.train import main

    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny/dense.yaml", "--config", "configs/tiny/mod.yaml", "--print-config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--config given twice" in err[0], err


@pytest.mark.parametrize("config,overrides,line", [
    ("dense", ["model.mod.kv=all"], "model.mod.kv='all': selected (the default) unless model.mod.layers names a "
                                    "depth-routed layer (model.mod.layers='none' routes none)"),
    ("dense", ["model.mod.decoupled=true"], "model.mod.decoupled=True: false (the default) unless model.mod.layers"),
    ("dense", ["model.mod.decoupled=true", "model.mod.attn_capacity=0.5"], "model.mod.decoupled=True: false"),
    ("dense", ["model.mod.gate=sigmoid"], "model.mod.gate='sigmoid': identity (the default) unless"),
    ("dense", ["model.mod.routing=stochastic"], "model.mod.routing='stochastic': learned (the default) unless"),
    ("mod", ["model.mod.layers=[]", "model.mod.kv=all"], "model.mod.kv='all': selected (the default) unless "
                                                          "model.mod.layers names a depth-routed layer "
                                                          "(model.mod.layers=[] routes none)"),
    ("dense", ["model.moe.num_noop_experts=2"], "model.moe.num_noop_experts=2: 0 unless model.moe.layers names an "
                                                "MoE layer (model.moe.layers='none' names none)"),
])
def test_a_variant_key_with_nothing_to_act_on_is_refused(config, overrides, line):
    """Bug caught: `model.mod.kv=all` or `model.mod.decoupled=true` (or the sigmoid gate, stochastic
    routing, no-op experts) on a config with no layer they act on was accepted and trained the plain
    model under the variant's name. Keys a grid may share with a dense variant (capacity, causal, loss
    weights, the MoE backend) stay accepted, as do all shipped configs."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / f"configs/tiny/{config}.yaml", overrides)
    msg = str(e.value)
    assert msg.startswith("config error: " + line) and "\n" not in msg, msg
    for ok in (["model.mod.capacity=0.5", "model.mod.causal=threshold", "model.mod.aux_loss_weight=0"],
               ["model.moe.backend=deepspeed", "model.moe.capacity_factor=0.5"]):
        load_config(ROOT / "configs/tiny/dense.yaml", ok)
    load_config(ROOT / "configs/tiny/mod.yaml", ["model.mod.kv=all", "model.mod.decoupled=true",
                                                 "model.mod.gate=sigmoid", "model.mod.routing=stochastic"])
    load_config(ROOT / "configs/tiny/mode_integrated.yaml")
    load_config(ROOT / "configs/tiny/mode_integrated.yaml", ["model.moe.num_noop_experts=0"])  # an ablation


def test_compiled_blocks_at_zero_1_need_a_d_model_that_keeps_their_views_aligned():
    """At ZeRO 1/2 a parameter is a view at its cumulative offset in DeepSpeed's flat buffer: a d_model
    that is not a multiple of 8 puts norm weights off the 16-byte alignment compiled blocks assume on
    CUDA (mode.engine.param_groups aligns only multiples of 8). Refused at load, on every device."""
    bad = ["train.compile=true", "deepspeed.zero_stage=1", "model.d_model=36", "model.n_heads=2"]
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny/mod.yaml", bad)
    assert str(e.value).startswith("config error: model.d_model=36: a multiple of 8 with train.compile=true")
    assert load_config(ROOT / "configs/tiny/mod.yaml", bad[1:]).model.d_model == 36  # eager: any size
    assert load_config(ROOT / "configs/tiny/mod.yaml", ["train.compile=true", "model.d_model=36", "model.n_heads=2"])
