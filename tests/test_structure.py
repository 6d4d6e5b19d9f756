"""The code's structure: one layer plan, the block contract, and an acyclic import graph."""
import ast
from pathlib import Path

import pytest
import torch

from mode.config import ModConfig, ModelConfig, MoEConfig
from mode.model import build_model
from mode.plan import has_depth_routing, has_moe, layer_plan
from mode.routed import Ctx, Routed
from tests.util import ROOT

PACKAGES = ("mode", "analysis")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at top level OR inside functions (a lazy import
    that closes a cycle is still a cycle: it only moves the failure to run time)."""
    mods = modules()
    graph = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        # Importing a.b.c first runs a/__init__ and a/b/__init__ (unless they are the importer's own
        # packages, already running): what they import is imported too.
        deps |= {p for t in deps for p in _parents(t) if p in mods and not (name + ".").startswith(p + ".")}
        graph[name] = deps
    return graph


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_cycles_in_mode_or_analysis():
    graph = import_graph()
    assert {"mode.model.lm", "mode.moe.native", "analysis.report", "analysis.isoflop"} <= set(graph)
    assert "mode.model.blocks" in graph["mode.model.lm"]  # the walker sees edges at all
    assert "mode.routing" in graph["mode.moe.base"]  # and the package __init__ an import of mode.routing.X runs
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # and the checker finds one when there is one
    assert find_cycle({**graph, "mode.routed": graph["mode.routed"] | {"mode.model.lm"}, "mode.model.lm": {"mode.routed"}})


def test_routed_protocol_module_imports_nothing_of_the_model():
    assert import_graph()["mode.routed"] == set()


def test_plan_is_the_one_source():
    cfg = ModelConfig(n_layers=4, mod=ModConfig(layers=[1, 2], capacity=[0.5, 0.25], kv="all"),
                      moe=MoEConfig(layers="every_other", num_noop_experts=2))
    cfg.validate()
    plan = layer_plan(cfg)
    assert [lp.kind for lp in plan] == ["dense", "mod(integrated)+kv_all", "mod(dense)+kv_all", "integrated"]
    assert [lp.block.capacity if lp.block else None for lp in plan] == [None, 0.5, 0.25, None]
    assert has_depth_routing(plan) and has_moe(plan)
    assert not has_depth_routing(layer_plan(ModelConfig())) and not has_moe(layer_plan(ModelConfig()))
    model = build_model(cfg)
    assert model.plan == plan
    tags = sorted(m.tag for m in model.modules() if isinstance(m, Routed))
    assert tags == ["mod/layer1", "mod/layer2", "moe/layer1", "moe/layer3"]


@pytest.mark.parametrize("mod", [dict(layers="none"), dict(layers="every", capacity=0.5),
                                 dict(layers="every", decoupled=True, attn_capacity=0.5, mlp_capacity=0.25)])
def test_every_block_returns_its_update_and_reports_engaged_tokens(mod):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_heads=2, d_ff=32, n_layers=2, mod=ModConfig(**mod))
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randn(2, 8, 16)
    for block in model.blocks:
        delta = block(x, Ctx(torch.arange(8).expand(2, 8)))
        assert delta.shape == x.shape
        eng = block.last_engaged_BS
        if eng is None:
            assert mod["layers"] == "none" and (delta != 0).any(-1).all()
        else:
            assert eng.dtype == torch.bool and eng.shape == (2, 8) and 0 < int(eng.sum()) < 16
            # tokens no sublayer engaged get exactly zero (x + 0 == x bit for bit)
            touched = eng if not mod.get("decoupled") else block.attn.last_selected_BS | block.mlp.last_selected_BS
            assert (delta[~touched] == 0).all() and (delta[touched] != 0).any(-1).all()


def test_checkpoints_from_before_the_sublayer_split_still_load():
    # Bug caught: renaming block weights (attention/MLP became sublayers) orphaning every saved run.
    import re

    cfg = ModelConfig(vocab_size=64, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                      mod=ModConfig(layers=[1], capacity=0.5))
    torch.manual_seed(0)
    model = build_model(cfg)
    old_names = {"attn.norm.": "norm_attn.", "attn.attn.": "attn.", "mlp.norm.": "norm_mlp.", "mlp.mlp.": "mlp."}
    old = {re.sub(r"^(blocks\.\d+\.(?:inner\.)?)(attn\.norm\.|attn\.attn\.|mlp\.norm\.|mlp\.mlp\.)",
                  lambda m: m.group(1) + old_names[m.group(2)], k): v.clone() for k, v in model.state_dict().items()}
    assert "blocks.1.inner.norm_attn.weight" in old and "blocks.0.mlp.w_in.weight" in old
    torch.manual_seed(1)
    fresh = build_model(cfg)
    fresh.load_state_dict(old)  # strict
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_only_mode_checkpoint_spells_the_checkpoint_layout():
    # Bug caught: the layout (checkpoints/step_XXXXXXXX/, MANIFEST.json, model.pt) parsed by its own
    # glob and regex in generate, by `name.split("_")` in compare and train: one of them drifts.
    import re

    spelled = re.compile(r"""["'/]step_[*{(\\\d"']|["']checkpoints["'/]|MANIFEST\.json|["']model\.pt["']|split\("_"\)""")
    assert spelled.search('f"step_{step:08d}"') and spelled.search('x / "checkpoints"')  # the check sees them
    assert not spelled.search('"perf/step_time_s"')
    offenders = [f"{f.relative_to(ROOT)}:{i}" for pkg in ("mode", "analysis", "launch", "benchmarks")
                 for f in sorted((ROOT / pkg).rglob("*.py")) if f != ROOT / "mode" / "checkpoint.py"
                 for i, line in enumerate(f.read_text().splitlines(), 1) if spelled.search(line)]
    assert offenders == []


def test_only_mode_config_spells_the_integer_check():
    # Bug caught: "an int, not a bool" spelled five times (generate's _int/_number, compare's nested
    # is_int, prepare's _is_int, inline in config): one copy that forgets the bool lets `true` be 1.
    import re

    spelled = re.compile(r"isinstance\(.*\b(int|float)\b.*isinstance\(.*\bbool\)"
                         r"|isinstance\(.*\bbool\).*isinstance\(.*\b(int|float)\b")
    assert spelled.search("isinstance(v, int) and not isinstance(v, bool)")  # the check sees them
    assert spelled.search("if isinstance(v, bool) or not isinstance(v, (int, float)):")
    defs = {"    return isinstance(v, int) and not isinstance(v, bool) and v >= least",  # mode.config.is_int
            "    return isinstance(v, (int, float)) and not isinstance(v, bool)"}  # mode.config.is_number
    offenders = [f"{f.relative_to(ROOT)}:{i}" for pkg in ("mode", "analysis", "launch", "benchmarks")
                 for f in sorted((ROOT / pkg).rglob("*.py"))
                 for i, line in enumerate(f.read_text().splitlines(), 1)
                 if spelled.search(line) and not (f == ROOT / "mode" / "config.py" and line in defs)]
    assert offenders == []


@pytest.mark.parametrize("module", ["mode/engine.py", "mode/moe/deepspeed.py", "mode/lifeline.py"])
def test_importing_the_engine_changes_no_environment(module, monkeypatch):
    # Bug caught: mode/engine.py set DS_ACCELERATOR (and with it every child process's accelerator)
    # as a side effect of `import mode.engine`. A fresh copy of the module's top-level code runs
    # here (its own imports are loaded already, so only its own code can change os.environ).
    import importlib
    import importlib.util
    import os

    importlib.import_module(module.removesuffix(".py").replace("/", "."))  # its imports (torch sets its own)
    for key in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location(f"fresh_{Path(module).stem}", ROOT / module)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert dict(os.environ) == before


def test_shm_buffer_name_is_the_one_deepspeed_creates(monkeypatch):
    # mode.engine.unlink_shm_buffer removes DeepSpeed's per-rank /dev/shm segment by name; if a
    # DeepSpeed upgrade renamed it, every multi-rank CPU run would leak 66 MB per rank again. The
    # name is read from the installed DeepSpeed's own source (csrc/cpu/comm/shm.cpp).
    import os
    import re
    from pathlib import Path

    import deepspeed

    from mode.engine import shm_buffer

    src = (Path(deepspeed.__file__).parent / "ops/csrc/cpu/comm/shm.cpp").read_text()
    base = re.search(r'#define SHM_BUFFER_NAME "([^"]+)"', src).group(1)
    assert re.search(r'"%s_%d_%s_%s",\s*SHM_BUFFER_NAME,\s*getuid\(\),\s*addr_string,\s*port_string', src)
    assert re.search(r'snprintf\(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank\)', src)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert shm_buffer(3) == Path(f"/dev/shm/{base}_{os.getuid()}_10.0.0.7_29511_3")


def test_a_plan_routing_one_sublayer_alone_is_named_and_summarised(monkeypatch):
    """A new variant that routes only the MLP (or only attention) is a LayerPlan with one sublayer
    route: `kind` called it `dense` and the start block's summary crashed on the missing one."""
    import mode.console as console
    from mode.config import load_config
    from mode.plan import LayerPlan, Route

    plan = [LayerPlan(index=0, mlp="dense"), LayerPlan(index=1, mlp="dense", mlp_route=Route(0.5, "mod_mlp/layer1")),
            LayerPlan(index=2, mlp="moe", attn=Route(0.25, "mod_attn/layer2", "all"))]
    assert [lp.kind for lp in plan] == ["dense", "mod_split(dense)", "mod_split(moe)+kv_all"]
    monkeypatch.setattr(console, "layer_plan", lambda model_cfg: plan)
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", [])
    assert "MoD capacity by layer {1: mlp 0.5, 2: attn 0.25 K/V from all}" in console.routing_summary(cfg)


def test_the_layer_plan_imports_no_torch():
    """Bug caught (variants walkthrough): plan.py says "No torch here", but LayerPlan.mlp_frac imported
    mode.routing.depth (torch) for capacity_k, so the analysis's processed fractions loaded torch.
    Every import in plan.py and mode/config.py, function-level ones included, is of the standard
    library or of mode.config."""
    import ast
    import sys

    for f in ("mode/plan.py", "mode/config.py"):
        tree = ast.parse((ROOT / f).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        foreign = {m for m in names if m.split(".")[0] not in sys.stdlib_module_names and m != "mode.config"}
        assert foreign <= {"yaml"}, (f, foreign)
