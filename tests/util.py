"""Helpers for tests that run the real CLI, the DeepSpeed launcher and TensorBoard files."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEEPSPEED = str(Path(PY).parent / "deepspeed")

# Small enough that a run of a few dozen steps takes seconds on 2 cores.
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "data.seq_len=32",
        "data.max_documents=24", "train.micro_batch_size=4", "train.eval_batches=2", "log.progress=false"]


def env(threads: int = 1) -> dict:
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def no_flock(monkeypatch, module) -> None:
    """A filesystem without flock (Lustre mounted without -o flock): `module`'s flock raises ENOSYS
    (that module's only: `datasets`' own file locks keep working)."""
    import errno

    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(module, "flock", flock)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mode_cli(*args, check=True, timeout=600, threads=2, extra_env=None, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([PY, "-m", "mode.cli", *map(str, args)], cwd=cwd, env={**env(threads), **(extra_env or {})},
                       capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"mode {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def mode_here(capsys, monkeypatch, *args) -> subprocess.CompletedProcess:
    """`mode ...` in this process, from the repository root, for a test about what a command refuses,
    prints or writes rather than about its process (mode_cli starts one): the return code, stdout and
    stderr as a CompletedProcess. The SIGTERM/SIGINT handlers a command installs (compare) are put back."""
    import signal

    from mode.cli import main

    monkeypatch.chdir(ROOT)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["mode", *map(str, args)], rc, out.out, out.err)


def leave_world(out) -> None:
    """End a spawned test rank the way `mode train` ends a launched one: destroy the process group,
    flush the result queue, then os._exit(0). Left to interpreter teardown, gloo's and DeepSpeed's C++
    threads abort a finished rank now and then ("terminate called without an active exception",
    SIGABRT: CI lost a passing test_the_predictors_are_averaged_across_ranks_at_zero_1 so)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    out.close()
    out.join_thread()  # the put is in the pipe before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def leaked_shm(port: int) -> list[str]:
    """Shared-memory segments DeepSpeed's CPU comm op made for a run on `port` still in /dev/shm
    (mode.engine.shm_buffer names them; a finished run must leave none: 66 MB of RAM each)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def process_group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in process group `pgid`."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError):
            pass  # exited while we looked
    return out


def orphan_semaphores(before: set[str]) -> list[str]:
    """POSIX semaphores (multiprocessing's `sem.mp-*`) that appeared in /dev/shm since `before`
    and that no live process maps: leaked, since sem_open maps each one it opens."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(re.findall(r"/dev/shm/(sem\.mp-\S+)", maps.read_text()))
        except OSError:
            pass
    return sorted(p.name for p in Path("/dev/shm").glob("sem.mp-*") if p.name not in before | mapped)


def deepspeed_train(nproc: int, config: str, *overrides, check=True, timeout=600) -> subprocess.CompletedProcess:
    """A run through the real DeepSpeed launcher; with check, it must succeed and leave no
    shared memory behind."""
    port = free_port()
    cmd = [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(port), "--module", "mode.train",
           "--config", config, *map(str, overrides)]
    r = subprocess.run(cmd, cwd=ROOT, env=env(1), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        Path("/tmp/ds_fail.log").write_text(r.stdout + r.stderr)
        raise AssertionError(f"deepspeed run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    if check:
        assert not leaked_shm(port), f"the run left shared memory behind: {leaked_shm(port)}"
    return r


def side_by_side(*launches):
    """Call independent launches (zero-argument callables, e.g. `lambda: mode_cli(...)`) two at a
    time; return their results in order. A starting process spends most of a tiny run importing
    torch on one core, so on the 2-core CI machine a second one beside it costs little wall time.
    Give each launch one thread (`mode_cli(..., threads=1)`): two 2-thread OpenMP pools on 2 cores spin."""
    with ThreadPoolExecutor(2) as pool:
        return [f.result() for f in [pool.submit(launch) for launch in launches]]


def scalars(run_dir, tag: str) -> dict[int, float]:
    """step -> value from the run's TensorBoard files (latest write wins on resumed runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, tuple[float, float]] = {}
    for f in sorted(Path(run_dir, "tb").glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f), size_guidance={"scalars": 0})
        ea.Reload()
        if tag in ea.Tags()["scalars"]:
            for e in ea.Scalars(tag):
                if e.step not in out or e.wall_time >= out[e.step][0]:
                    out[e.step] = (e.wall_time, e.value)
    return {s: v for s, (_, v) in sorted(out.items())}


def fake_checkpoint(run_dir, step: int, state_dict: dict, config: dict | None = None, data: dict | None = None) -> Path:
    """A checkpoint as sampling, `mode eval` and `mode export` read it (model.pt, with `config` its
    record of the trained config, `data` of its data, and the manifest that makes it count; no
    DeepSpeed files), placed where mode/checkpoint.py says; returns its directory."""
    import torch

    from mode import checkpoint as ckpt

    d = ckpt.step_dir(ckpt.checkpoints_dir(run_dir), step)
    d.mkdir(parents=True)
    torch.save(state_dict, d / ckpt.MODEL)
    for name, record in ((ckpt.CONFIG, config), (ckpt.DATA, data)):
        if record is not None:
            ckpt.write_record(d, name, record)
    ckpt.write_manifest(d, step)
    return d


# Untrained tiny models for the sampling-time tests (`mode eval`, `mode export`): a short window,
# so documents span several of them.
HARNESS_L = 24  # model.max_seq_len
HARNESS_SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", f"model.max_seq_len={HARNESS_L}",
                 f"data.seq_len={HARNESS_L}"]
# moe+capped: expert slots capped at sampling time (inference_capacity_factor), so the rows of a
# batch would share them: the one case scored a row at a time
HARNESS_PRESETS = ["dense", "mod", "moe", "moe+capped", "mode_staged", "mode_integrated"]


def tiny_model(preset: str, seed: int = 0):
    """An untrained model of a tiny preset (HARNESS_PRESETS), routers spread so that routing
    differs per token; returns (model in eval mode, config)."""
    import torch

    from mode.config import load_config
    from mode.mod import MoDBlock
    from mode.model import build_model

    name, _, variant = preset.partition("+")
    cfg = load_config(ROOT / f"configs/tiny/{name}.yaml",
                      HARNESS_SMALL + (["model.moe.inference_capacity_factor=1.0"] if variant else []))
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    for b in model.blocks:
        if isinstance(b, MoDBlock):
            lin = b.router.predictor[2] if b.router.predictor is not None else b.router.router
            torch.nn.init.normal_(lin.weight, std=3.0 / lin.weight.shape[1] ** 0.5)
    return model, cfg


def fake_run(tmp_path, preset, name="run"):
    """A run directory as the trainer leaves it (config.yaml + checkpoints/step_N/model.pt)."""
    from mode.config import dump_config

    model, cfg = tiny_model(preset, seed=1)
    run = Path(tmp_path) / name
    fake_checkpoint(run, 3, model.state_dict(), cfg.to_dict())
    (run / "config.yaml").write_text(dump_config(cfg))
    return model, run


def main_guarded(src: str) -> str:
    """A script's body under `if __name__ == "__main__":`. A data prepare's tokenizer workers are
    spawned, and a spawned process imports the parent's main script (as __mp_main__): unguarded,
    each worker started a second Trainer, which found the run.dir in use and exited, and the
    prepare lost its workers (a script run from a fresh checkout, before the data was prepared)."""
    import textwrap

    return 'if __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(src), "    ")
