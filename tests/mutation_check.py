"""Do the tests catch the bugs they are named after? Plant one bug at a time (a mutant) in a copy
of the tree and run the fast tests that should catch it; a mutant the tests pass is a missed bug.

    .venv/bin/python tests/mutation_check.py [NAME_SUBSTRING ...]   # ~15 min for all on 2 cores

Each mutant is a one-line change a real implementation could plausibly get wrong (the mistakes
other MoD and MoE implementations make, and the exact routing semantics README states). The copy
lives in a temporary directory: the working tree is never edited. Not part of `make test`
(it runs the fast tier dozens of times); results are recorded in RELIABILITY.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOD = ["tests/test_mod.py", "tests/test_mod_variants.py", "tests/test_sampling.py"]
MOE = ["tests/test_moe.py", "tests/test_mode.py", "tests/test_sampling.py", "tests/test_generate.py"]
GEN = ["tests/test_sampling.py", "tests/test_generate.py"]
FLOPS = ["tests/test_flops.py", "tests/test_mod_variants.py"]
CKPT = ["tests/test_reliability.py"]

# (name, file, original text, mutated text, tests that must catch it)
MUTANTS = [
    # Depth routing (Mixture-of-Depths)
    ("top-k indices not sorted by position", "mode/routing/depth.py",
     "stable=True).indices[:, :k]\n", "stable=True).indices[:, :k].flip(1)\n", MOD),
    ("k = ceil(capacity * S), not round", "mode/routing/depth.py",
     "round(capacity * seq_len)", "int(capacity * seq_len + 0.999)", MOD),
    ("gathered tokens get positions 0..K-1", "mode/mod.py",
     "inner_ctx = Ctx(ctx.pos_BS.gather(1, idx_BK), valid_BK",
     "inner_ctx = Ctx(torch.arange(idx_BK.shape[1], device=idx_BK.device).expand_as(idx_BK), valid_BK", MOD),
    ("router weight off the gradient path", "mode/mod.py",
     "self.gate(r_BS.gather(1, idx_BK))", "self.gate(r_BS.detach().gather(1, idx_BK))", MOD),
    ("predictor without stop-gradient", "mode/routing/depth.py",
     "self.predictor(x_BSD.detach().to(w.dtype))", "self.predictor(x_BSD.to(w.dtype))", MOD),
    ("predictor trained on inverted targets", "mode/routing/depth.py",
     "bce_p = F.binary_cross_entropy_with_logits(p_BS, member_BS)",
     "bce_p = F.binary_cross_entropy_with_logits(p_BS, 1 - member_BS)", MOD),
    ("causal routing ignores padding", "mode/mod.py",
     "                sel_BS = sel_BS & ctx.valid_BS\n", "                pass\n", MOD),
    ("causal routing skips the inner unit when nothing is selected (EP collectives hang)", "mode/mod.py",
     "            K = max(K, 1)\n",
     "            if K == 0:\n                return torch.zeros_like(x_BSD)\n            K = max(K, 1)\n", MOD),
    ("a skipped unit's metrics reported again", "mode/model/lm.py",
     "            m.metrics = {}  # a unit", "            pass  # a unit", MOD),
    ("padding slots add their update", "mode/mod.py",
     "            upd_BKD = torch.where(valid_BK[..., None], upd_BKD, 0.0)  # padding slots add nothing\n",
     "            pass\n", MOD),
    ("decode step ignores invalid rows", "mode/mod.py",
     "            sel_B = sel_B & ctx.valid_BS[:, 0]\n", "            pass\n", MOD),
    ("decode takes the first N rows' positions", "mode/mod.py",
     "ctx.pos_BS.index_select(0, rows_N)", "ctx.pos_BS[:N]", MOD),
    ("threshold EMA momentum swapped", "mode/routing/depth.py",
     "m * self.threshold + (1 - m) * kth", "(1 - m) * self.threshold + m * kth", MOD),
    ("threshold tracks the largest score, not the k-th", "mode/routing/depth.py",
     "kth = r_BS.detach().topk(k, dim=1).values[:, -1].mean()", "kth = r_BS.detach().topk(k, dim=1).values[:, 0].mean()", MOD),
    ("router scores not in fp32", "mode/routing/depth.py",
     "F.linear(x_BSD.float(), w.weight.float(), w.bias.float()).squeeze(-1)",
     "F.linear(x_BSD, w.weight, w.bias).float().squeeze(-1)", MOD + ["tests/test_bf16.py"]),
    ("decoding step leaves out g(r)", "mode/mod.py",
     "upd_N1D = (self.gate(r_N1)[..., None] * delta_N1D).to(x_B1D.dtype)", "upd_N1D = delta_N1D.to(x_B1D.dtype)", MOD),
    ("threshold EMA starts from zero", "mode/routing/depth.py",
     "torch.where(self.threshold_updates == 0, kth, m * self.threshold + (1 - m) * kth)",
     "m * self.threshold + (1 - m) * kth", MOD),
    ("threshold EMA steps in eval mode", "mode/mod.py",
     "if self.training and self.router.has_threshold:", "if self.router.has_threshold:", MOD),
    ("the LM keeps one router's aux loss, not the sum", "mode/model/lm.py",
     "aux = aux + m.aux_loss", "aux = m.aux_loss", MOD + MOE),
    # Attention and initialisation
    ("attention mask excludes the diagonal", "mode/model/layers.py",
     "mask_BST = kv_pos_BT[:, None, :] <= pos_BS[:, :, None]",
     "mask_BST = kv_pos_BT[:, None, :] < pos_BS[:, :, None] + (kv_pos_BT[:, None, :] == 0)", MOD),
    ("rotary frequencies wrong", "mode/model/layers.py",
     "torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)",
     "torch.arange(0, head_dim, 2, dtype=torch.float64) / (head_dim // 2))", MOD),
    ("rotary rotation sign", "mode/model/layers.py",
     "torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)",
     "torch.stack((x1 * cos + x2 * sin, x1 * sin + x2 * cos), dim=-1)", MOD),
    ("residual output projections not scaled by depth", "mode/model/layers.py",
     "s = std / math.sqrt(2 * n_layers) if", "s = std if", ["tests/test_train.py"]),
    # Expert routing (Mixture-of-Experts)
    ("expert capacity off by one", "mode/routing/experts.py",
     "keep_TK = real_TK & (pos_TK < cap)", "keep_TK = real_TK & (pos_TK <= cap)", MOE),
    ("capacity rounded, not ceil (host)", "mode/routing/experts.py",
     "return max(math.ceil(np.float32(num_tokens / num_experts) * np.float32(cf_k)), min_capacity)",
     "return max(round(np.float32(num_tokens / num_experts) * np.float32(cf_k)), min_capacity)", MOE),
    ("capacity floor, not ceil (device)", "mode/routing/experts.py",
     "torch.ceil(per_expert * cf.to(per_expert.device))", "torch.floor(per_expert * cf.to(per_expert.device))", MOE),
    ("capacity counts padding tokens", "mode/routing/experts.py",
     "n_valid = T if valid_T is None else valid_T.sum()", "n_valid = T", MOE),
    ("MoE layer ignores the padding mask", "mode/moe/base.py",
     "r = self.router(x_TD, None if valid_BS is None else valid_BS.reshape(-1))", "r = self.router(x_TD, None)", MOE),
    ("sampling uses the training capacity", "mode/moe/base.py",
     'self.router.sampling = routing == "causal"', "self.router.sampling = False", MOE),
    ("drop order token-major, not choice-major", "mode/routing/experts.py",
     "key_R = torch.where(real_TK, idx_TK, E).t().reshape(-1)", "key_R = torch.where(real_TK, idx_TK, E).reshape(-1)", MOE),
    ("probability drop policy reversed", "mode/routing/experts.py",
     "by_prob_R = torch.argsort(-p_TK.detach().t().reshape(-1), stable=True)",
     "by_prob_R = torch.argsort(p_TK.detach().t().reshape(-1), stable=True)", MOE),
    ("top-1 weight renormalised to 1", "mode/routing/experts.py",
     "if K > 1 and cfg.normalize_weights:", "if cfg.normalize_weights:", MOE),
    ("renormalise_after_drop ignored", "mode/routing/experts.py",
     "live_TK = (keep_TK | noop_TK) if cfg.renormalize_after_drop else torch.ones_like(keep_TK)",
     "live_TK = torch.ones_like(keep_TK)", MOE),
    ("load-balancing loss without the E factor", "mode/routing/experts.py",
     "lb = f_E.numel() * (f_E * P_E).sum()", "lb = (f_E * P_E).sum()", MOE),
    ("z-loss not squared", "mode/routing/experts.py",
     "z = torch.logsumexp(logits_TX, -1).square().mean()", "z = torch.logsumexp(logits_TX, -1).abs().mean()", MOE),
    ("noop_balance=include ignored", "mode/routing/experts.py",
     'if self.N and cfg.noop_balance == "include":', "if False:", MOE),
    ("router jitter at evaluation", "mode/routing/experts.py",
     "if self.training and self.cfg.jitter > 0:", "if self.cfg.jitter > 0:", MOE),
    ("combine ignores router weights", "mode/moe/native.py",
     "return (routed_TKD * w_TK[..., None]).sum(1).to(out_MD.dtype)", "return routed_TKD.sum(1).to(out_MD.dtype)", MOE),
    ("dropped tokens count no-op routes", "mode/routing/experts.py",
     "dropped_tok = (real_TK.any(-1) & ~keep_TK.any(-1)).sum()", "dropped_tok = (~keep_TK.any(-1)).sum()", MOE),
    ("load_max measured before dropping", "mode/routing/experts.py",
     '"load_max": kept_E.max().float() * E / (K * n_tok)', '"load_max": counts_E.max().float() * E / (K * n_tok)', MOE),
    ("renormalised weights leave out no-op routes", "mode/routing/experts.py",
     "live_TK = (keep_TK | noop_TK) if cfg.renormalize_after_drop", "live_TK = keep_TK if cfg.renormalize_after_drop", MOE),
    ("load balance counts routes after dropping", "mode/routing/experts.py",
     "        counts_lb = counts_E\n", "        counts_lb = kept_E\n", MOE),
    ("no-op share left in P_e when excluded from balance", "mode/routing/experts.py",
     "            probs_TE = logits_TX[:, :E].softmax(-1)", "            probs_TE = probs_TX[:, :E]", MOE),
    # Sampling
    ("temperature multiplies the logits", "mode/generate.py",
     "keepdim=True)) / temperature", "keepdim=True)) * temperature", GEN),
    ("top-k keeps k-1 ids", "mode/generate.py",
     "logits_BV.masked_fill(logits_BV < kth_B1", "logits_BV.masked_fill(logits_BV <= kth_B1", GEN),
    ("top-p drops the id that reaches p", "mode/generate.py",
     "drop_BV = p_BV.cumsum(-1) - p_BV >= top_p", "drop_BV = p_BV.cumsum(-1) >= top_p", GEN),
    # FLOPs and efficiency
    ("MoD unit counted at the capacity fraction, not k/S", "mode/mod.py",
     "Cost(inner.params, inner.flops * k / seq_len)", "Cost(inner.params, inner.flops * capacity)", FLOPS),
    ("router FLOPs miscounted", "mode/routing/depth.py",
     "c = Cost(d_model + 1, 2 * d_model)", "c = Cost(d_model + 1, 2 * d_model + 1)", FLOPS),
    ("K/V-from-all attention scores counted over queries", "mode/model/layers.py",
     "+ 4 * s_kv * d)", "+ 4 * s * d)", FLOPS),
    ("predictor FLOPs left out", "mode/routing/depth.py",
     "c = c + Cost(d_model * h + h + h + 1, 2 * d_model * h + 2 * h)", "c = c + Cost(d_model * h + h + h + 1, 2 * h)", FLOPS),
    ("MoD router counted on processed tokens only", "mode/mod.py",
     "return DepthRouter.cost(d_model, cfg) + Cost(inner.params, inner.flops * k / seq_len)",
     "c = DepthRouter.cost(d_model, cfg)\n        return Cost(c.params + inner.params, (c.flops + inner.flops) * k / seq_len)", FLOPS),
    ("MoE router FLOPs over real experts only", "mode/moe/base.py",
     "2 * d * n_out + rows * e.flops", "2 * d * m.num_experts + rows * e.flops", FLOPS),
    ("expert FLOPs ignore the capacity factor", "mode/moe/base.py",
     "frac = 1.0 if m.capacity_factor is None else min(1.0, m.capacity_factor)", "frac = 1.0", FLOPS),
    ("expert FLOPs at d_ff, not d_expert", "mode/moe/base.py",
     "e = MLP.cost(d, m.d_expert or cfg.d_ff, cfg.mlp)", "e = MLP.cost(d, cfg.d_ff, cfg.mlp)", FLOPS),
    ("TFLOP/s per device ignores the world size", "mode/metrics.py",
     "forward_flops_per_token * tokens_per_s / world / 1e12", "forward_flops_per_token * tokens_per_s / 1e12",
     ["tests/test_logging.py"]),
    # Data
    ("ranks read overlapping training samples", "mode/data.py",
     "start = ((step * accum + micro) * self.world + self.rank) * micro_batch",
     "start = ((step * accum + micro) + self.rank) * micro_batch", ["tests/test_data.py"]),
    ("ranks read overlapping eval samples", "mode/data.py",
     "((b * self.world + self.rank) * micro_batch + j)", "((b + self.rank) * micro_batch + j)", ["tests/test_data.py"]),
    ("sample order not a permutation", "mode/data.py",
     "        while x >= n:\n            x = once(x)\n", "        x = x % n\n", ["tests/test_data.py"]),
    ("same sample order every epoch", "mode/data.py",
     "self.cfg.split_seed * 1000003 + int(e))", "self.cfg.split_seed * 1000003)", ["tests/test_data.py"]),
    ("eval/bpb counts a prepended space as a byte", "mode/data.py",
     "total += int(nbytes[d]) - int(table[tokens].sum())", "total += 0", ["tests/test_data.py"]),
    ("noop_balance exclude renormalises P by a sum clamped at eps", "mode/routing/experts.py",
     "probs_TE = logits_TX[:, :E].softmax(-1)",
     "probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(probs_TE.dtype).eps)", MOE),
    # Checkpoints
    ("checksum not compared on load", "mode/checkpoint.py",
     '        if _sha256(p) != meta["sha256"]:\n', "        if False:\n", CKPT),
    ("size not compared on load", "mode/checkpoint.py",
     '        if size != meta["bytes"]:\n', "        if False:\n", CKPT),
    ("every checkpoint damaged: the run restarts in its own directory", "mode/checkpoint.py",
     "        if found[1]:\n", "        if False:\n", CKPT),
    # Run directories and prepared data
    ("a run is recognised by its entries' names alone", "mode/rundir.py",
     "    return True in found and False not in found\n", "    return bool(found)\n", CKPT),
    ("rotation deletes any *.tmp directory in checkpoints/", "mode/checkpoint.py",
     'root.glob("step_*.tmp")', 'root.glob("*.tmp")', CKPT),
    ("rotation deletes a user's file inside an old checkpoint", "mode/checkpoint.py",
     "        _remove_checkpoint(old)\n", "        shutil.rmtree(old, ignore_errors=True)\n", CKPT),
    ("run.fresh deletes a user's file inside a checkpoint", "mode/rundir.py",
     "        if fresh:  # a file put into", "        if False:  # a file put into", CKPT),
    ("prepare --force deletes a user's file inside a prepared directory", "mode/prepare.py",
     "    foreign = sorted(p.name for p in path.iterdir() if not OURS.match(p.name))\n", "    foreign = []\n",
     ["tests/test_data.py"]),
    ("a task's seed: null samples with seed 0", "mode/harness.py",
     'seed = self.seed if kw.get("seed") is None else int(kw["seed"])',
     'seed = int(kw.get("seed", self.seed) or 0)', ["tests/test_harness.py"]),
    ("a report may go anywhere inside a run but its top level", "mode/rundir.py",
     "(below is None or below.name != owned)", "(below is None or below.name not in ARTEFACTS)",
     ["tests/test_analysis.py", "tests/test_harness.py"]),
    ("a cut prepared shard is trained on", "mode/prepare.py",
     "    bad = damaged_files(path, manifest)\n", "    bad = []\n", ["tests/test_data.py"]),
    # Start-up
    ("a build lock held open is called stale", "mode/lifeline.py",
     "                if os.readlink(fd) == str(lock):\n                    return True\n",
     "                if False:\n                    return True\n", CKPT),
    ("a holder's fd closing mid-scan skips the busy holder", "mode/lifeline.py",
     "                continue  # closed since it was listed",
     "                break  # closed since it was listed", CKPT),
    ("W&B online without a login passes the pre-launch check", "mode/train.py",
     'if cfg.log.wandb and cfg.log.wandb_mode == "online" and not _wandb_logged_in():',
     'if False:', CKPT),
    # Configs, runs and reports
    ("a YAML merge key is constructed like any key", "mode/config.py",
     '            if k.tag == "tag:yaml.org,2002:merge":', '            if False:', ["tests/test_config.py"]),
    ("a re-scheduled run is a seed of plain runs", "analysis/tb.py",
     '    if run.info.get("schedule_changes"):', '    if False:', ["tests/test_analysis.py"]),
    ("a grid inside a run is accepted", "mode/compare.py",
     "    check_outside_runs(shown, key, below_only=True)", "    pass", ["tests/test_compare.py"]),
    ("a full disk at a metrics write names the cwd", "mode/loggers.py",
     "            e.filename = e.filename or str(self.run_dir)", "            pass", CKPT),
    ("a project folder with its own checkpoints/ is taken for a run", "mode/rundir.py",
     "is_mode_run(d, below.name if below is not None else None, proofs)", "any((d / s).exists() for s in proofs)",
     ["tests/test_compare.py"]),
    ("eval's default --out replaces a user's file", "mode/harness.py",
     "    if out.exists() and not written_by_mode_eval(out):", "    if explicit and out.exists() and not written_by_mode_eval(out):",
     ["tests/test_harness.py"]),
    ("the processed fraction from the logs ignores drops", "analysis/report.py",
     "frac[lp.index] *= engaged if engaged is not None else 1.0 - noop", "frac[lp.index] *= 1.0 - (noop or 0.0)",
     ["tests/test_analysis.py"]),
    ("threshold metrics scored after the EMA stepped on the batch", "mode/mod.py",
     "            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)\n"
     "            if self.training and self.router.has_threshold:\n                self.router.update_threshold(r_BS, k)\n",
     "            if self.training and self.router.has_threshold:\n                self.router.update_threshold(r_BS, k)\n"
     "            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)\n", MOD),
    ("a MegaBlocks down projection initialised at the full std", "mode/model/layers.py",
     '"w_out", "experts.mlp.w2"))', '"w_out"))', ["tests/test_train.py"]),
    ("compare and the trainer disagree on a finished run", "mode/compare.py",
     "if (d / \"DONE\").exists() and step >= run.cfg.train.max_steps", "if (d / \"DONE\").exists()",
     ["tests/test_compare.py"]),
    # Session 11: nothing lost (issue #16 audit)
    ("the continue command keeps run.fresh=true", "mode/console.py",
     'o.startswith(("train.stop_at=", "run.fresh="))', 'o.startswith("train.stop_at=")', ["tests/test_logging.py"]),
    ("run.fresh deletes eval/ and wandb/", "mode/rundir.py",
     'KEPT_BY_FRESH = (REPORT, "eval", "wandb")', "KEPT_BY_FRESH = (REPORT,)", CKPT),
    ("run.fresh deletes config.yaml before the checkpoints", "mode/rundir.py",
     'order = {CHECKPOINTS: 0, "config.yaml": 2}', "order = {}", CKPT),
    ("a run.dir inside another run is accepted", "mode/rundir.py",
     "    check_outside_runs(run_dir, key, below_only=True, proofs=RUN_PROOFS)  # not nested inside another run\n",
     "", CKPT),
    ("a damaged manifest that parses crashes the resume", "mode/checkpoint.py",
     'isinstance(meta, dict) and isinstance(meta.get("bytes"), int)', "True or isinstance(meta.get(\"bytes\"), int)",
     CKPT),
    ("a second moved-aside checkpoint (.bad2) unmakes the run", "mode/rundir.py",
     r"(\.tmp|\.bad\d*)?$", r"(\.tmp|\.bad)?$", CKPT),
    ("checkpoints without config.yaml resume under any config", "mode/train.py",
     "        if n:  # resuming would load them", "        if False:  # resuming would load them", CKPT),
    ("lock probes take the lock exclusively", "mode/rundir.py",
     "fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)", "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", CKPT),
    ("a requeued fresh job deletes what it trained", "mode/train.py",
     '.get("slurm_job_id") == job', '.get("slurm_job_id") == job and False', CKPT),
    # Session 11: sampling (issue #11 audit)
    ("a tiny temperature overflows the logits", "mode/generate.py",
     "(logits_BV - logits_BV.amax(-1, keepdim=True)) / temperature", "logits_BV / temperature", GEN),
    ("a stop string is read as its characters", "mode/generate.py",
     "    if isinstance(stop, str):  # one string, not its characters\n        stop = [stop]\n", "", GEN),
    ("generate's length bound comes from the first prompt", "mode/generate.py",
     "key=n_tok.__getitem__, default=None)", "key=lambda j: -j, default=None)", CKPT),
    # Session 11: data (issue #10 audit)
    ("a prepare resumed mid-validation deletes the hashes read so far", "mode/prepare.py",
     '{"val_hashes.npy"} if st else set()', '{"val_hashes.npy"} if st and st["phase"] == "train" else set()',
     ["tests/test_data.py"]),
    ("validation hashes saved only when the validation phase ends", "mode/prepare.py",
     '        if phase == "val":  # the hashes', '        if False:  # the hashes', ["tests/test_data.py"]),
    ("a file added to the source is not stale", "mode/prepare.py",
     "added = sorted(current_files(cfg) - set(old_fp))", "added = []", ["tests/test_data.py"]),
    ("a numbered shard of a held-out split is not held out", "mode/prepare.py",
     "return shard or parts[-1] in HELD_OUT_NAMES", "return parts[-1] in HELD_OUT_NAMES", ["tests/test_data.py"]),
    ("code files named like a split (foo_test.go) are held out", "mode/prepare.py",
     "    if p.suffix.lower() not in DATA_SUFFIXES:\n        return False\n", "", ["tests/test_data.py"]),
    ("the vocabulary is the count of ids, not the largest + 1", "mode/prepare.py",
     "max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1",
     "self.tok.get_vocab_size(with_added_tokens=True)", ["tests/test_data.py"]),
    # Session 11: reports (issue #15 audit)
    ("a seed stopped early is averaged at its own last evaluation", "analysis/report.py",
     "eval_step = min(ends) if ends else None", "eval_step = None", ["tests/test_analysis.py"]),
    ("peak memory is the last process's", "analysis/report.py",
     'max(r.series("perf/memory_gb")[1], default=None)', 'r.last("perf/memory_gb")', ["tests/test_analysis.py"]),
    ("an H100 PCIe gets the SXM peak", "mode/metrics.py",
     'PEAK_TFLOPS = {"H100 PCIe": {"bf16": 756.0, "fp32": 51.0}, ', "PEAK_TFLOPS = {", ["tests/test_logging.py"]),
    # Session 11: evaluation (issue #14 audit)
    ("every sampled eval request draws with one seed", "mode/harness.py",
     "(seed + i) % 2**64, i)", "seed % 2**64, i)", ["tests/test_harness.py"]),
    ("a task's top_p is ignored", "mode/harness.py",
     'float(kw.get("top_p") or 1.0)', "1.0", ["tests/test_harness.py"]),
    ("an export records sampling's stand-in data source", "mode/generate.py",
     "        cfg.data.source = data.get(\"source\", cfg.data.source)\n", "", ["tests/test_export.py"]),
    # Session 12: cluster launch (issue #17) and the layer plan (issue #12) audits
    ("pdsh replaces %h in an --env value", "launch/run.py",
     """re.sub(r'([\\\\$`"])', r"\\\\\\1", v)).replace("%", "%%")""", """re.sub(r'([\\\\$`"])', r"\\\\\\1", v))""",
     ["tests/test_cluster.py"]),
    ("overrides re-parsed by the remote shell", "launch/run.py",
     "        args = [pdsh_arg(x) for x in args]", "        pass", ["tests/test_cluster.py"]),
    ("top_k above the real experts counted as top_k rows", "mode/moe/base.py",
     "rows = min(m.num_experts, m.top_k * frac)", "rows = m.top_k * frac", FLOPS),
    ("a capacity list pairs with out-of-order layers silently", "mode/config.py",
     "_check(not isinstance(self.layers, list) or self.layers == sorted(set(self.layers)),",
     "_check(True,", ["tests/test_mod_variants.py"]),
    ("compare prepares data before checking later variants", "mode/compare.py",
     "preflight(r.cfg, lock=slurm_active_job(exp, r) is None, prepare_data=prepare)",
     "preflight(r.cfg, lock=slurm_active_job(exp, r) is None, prepare_data=prepare_data)",
     ["tests/test_compare.py"]),
    ("one routed sublayer alone is named dense", "mode/plan.py",
     "if self.attn is not None or self.mlp_route is not None:", "if self.attn is not None:",
     ["tests/test_structure.py"]),
    # Session 12: a new user's walk through the README
    ("prepare --force deletes the old data before the new is complete", "mode/prepare.py",
     "            _check_ours(out)  # replaced once", "            _remove_ours(out)  # replaced once",
     ["tests/test_data.py"]),
    ("eval's --out checked by os.access (root passes)", "mode/harness.py",
     '        fd, probe = tempfile.mkstemp(dir=place, prefix=".mode-eval-probe-")\n        os.close(fd)\n'
     "        os.unlink(probe)\n", "        os.access(place, os.W_OK)\n", ["tests/test_harness.py"]),
    ("a repeated seed counted as another seed", "analysis/tb.py",
     '            s["repeat"] = seen[k]', '            s["repeat"] = 1', ["tests/test_analysis.py"]),
    ("flops --match --json drops the solved knob", "mode/cli.py",
     'print(json.dumps({**c, "match": solved} if a.match else c))', "print(json.dumps(c))", ["tests/test_flops.py"]),
    # Session 13: a review, a fault injector, an MoE/FLOP-matching audit
    ("run.dir x/.. not folded (every check skipped)", "mode/config.py",
     "    return os.path.normpath(os.path.expanduser(p)) if p.strip() else p", "    return os.path.expanduser(p)", CKPT),
    ("YAML keys that are not strings reach difflib (TypeError)", "mode/config.py",
     "        if not isinstance(k, str):  # YAML reads", "        if False:  # YAML reads", CKPT),
    ("processed fraction from the logs at the nominal capacity, not k/S", "mode/plan.py",
     "return 1.0 if r is None else capacity_k(r.capacity, seq_len) / seq_len", "return 1.0 if r is None else r.capacity",
     ["tests/test_analysis.py"]),
    ("a resumed run's points past the resume kept", "analysis/tb.py",
     "        return any(wall < lim[0] and step > lim[at] for lim in limits)", "        return False",
     ["tests/test_analysis.py"]),
    ("threshold runs report the sign rule's accuracy", "analysis/report.py",
     'for name in ("predictor_acc", "threshold_acc", "router_causal_acc"):',
     'for name in ("predictor_acc", "router_causal_acc", "threshold_acc"):', ["tests/test_analysis.py"]),
    ("isoFLOP points from runs not evaluated at their budget", "analysis/isoflop.py",
     'return pts[-1].value if pts else run.last("eval/loss") if run.done else None', 'return run.last("eval/loss")',
     ["tests/test_analysis.py"]),
    ("an I/O error mid-prepare taken for bad input", "mode/prepare.py",
     "        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno is not None):",
     "        if False:", ["tests/test_data.py"]),
    ("torchrun on several nodes without a master address", "launch/run.py",
     'if a.launcher == "torchrun" and a.num_nodes > 1 and not a.master_addr:', "if False:", ["tests/test_launch.py"]),
    # Session 14: a review of session 13's changes
    ("a failed atomic write leaves its temporary file (the run.dir refused for good)", "mode/rundir.py",
     "        tmp.unlink(missing_ok=True)\n        raise", "        raise", CKPT),
    ("metrics.jsonl's rewrite temp file is not a run artefact", "mode/rundir.py",
     ', ".metrics.jsonl.tmp"}', "}", CKPT),
    ("a checkpoint rotated away while a reader verifies it fails the reader", "mode/checkpoint.py",
     "    except FileNotFoundError:  # a reader", "    except ZeroDivisionError:  # a reader", CKPT),
    ("export blames its output for a file it could not read", "mode/export.py",
     "            if io.filename in {str(src) for src, _ in tok_files}:", "            if False:", ["tests/test_export.py"]),
    # Session 15: a fuzz of every config field, launcher option and experiment key
    ("an integer past int64 accepted (fails after the workers start)", "mode/config.py",
     "    if tp is int and not -2**63 <= value < 2**63:", "    if False:", CKPT),
    ("every_other on a 1-layer model: a dense model labelled mod", "mode/config.py",
     '_check(spec != "every_other" or n_layers >= 2, key, spec,', "_check(True, key, spec,", CKPT),
    ("a causal router with loss weight 0 accepted (never trained)", "mode/config.py",
     "        if n_routed:  # a zero weight", "        if False:  # a zero weight", CKPT),
    ("a node rank outside 0..nodes-1 reaches the rendezvous", "launch/run.py",
     "        if a.node_rank is not None and not 0 <= a.node_rank < n_nodes:", "        if False:",
     ["tests/test_launch.py"]),
    ("compare drops a user's train.seed silently", "mode/compare.py",
     "        if key in SET_PER_RUN:", "        if False:", ["tests/test_compare.py"]),
    ("match_flops compares a variant with itself", "mode/compare.py",
     "and len(set(names)) == len(names) >= 2):", "and len(names) >= 2):", ["tests/test_compare.py"]),
    ("a task's bad generation_kwargs found mid-evaluation", "mode/harness.py",
     '                ignored = check_gen_kwargs(task.get_config("generation_kwargs"), f"task {name}: ")',
     "                ignored = []",
     ["tests/test_harness.py"]),
    # Session 16
    ("a task's unimplemented generation_kwargs (num_beams) ignored silently", "mode/harness.py",
     "                if ignored:\n", "                if False:\n", ["tests/test_harness.py"]),
    ("a bare `until: \"\"` refused (an empty string in a list is skipped)", "mode/harness.py",
     'v = [x for x in ([v] if isinstance(v, str) else v) if x != ""]',
     'v = [v] if isinstance(v, str) else [x for x in v if x != ""]', ["tests/test_harness.py"]),
    ("a warmup longer than the run: the warning's LR peak one step short of the schedule's", "mode/console.py",
     "o.lr * n / o.warmup_steps", "o.lr * (n - 1) / o.warmup_steps", ["tests/test_logging.py"]),
    ("DeepSpeed's ZeRO recovery scripts make checkpoints/ foreign (ZeRO runs never resume)", "mode/rundir.py",
     "all(s or e.name in DEEPSPEED_SCRIPTS and e.is_file() for", "all(s or False for", CKPT),
    # Session 16: a code review (the predictor's gradients in the LM's clipping norm), the harness
    ("the causal predictors in the engine's optimizer (their norm clips the LM)", "mode/engine.py",
     "if not p.requires_grad or id(p) in own:", "if not p.requires_grad:", ["tests/test_train.py"]),
    ("the causal predictors not clipped by their own norm", "mode/engine.py",
     "(self.clip / (norm + 1e-6)).clamp(max=1.0)", "1.0", ["tests/test_train.py"]),
    ("the causal predictors step on a non-finite gradient", "mode/engine.py",
     "self.opt.found_inf = (~finite).float()", "self.opt.found_inf = None", ["tests/test_train.py"]),
    ("topk scoring of a dense model one request at a time", "mode/harness.py",
     "        return not has_depth_routing(plan) and not has_moe(plan)", "        return False",
     ["tests/test_harness.py"]),
    ("top-k ties broken by torch.topk's kernel, not by position", "mode/routing/depth.py",
     "    kth_B1 = scores_BS.topk(k, dim=1).values[:, -1:]\n",
     "    return scores_BS.topk(k, dim=1, sorted=False).indices.sort(dim=1).values\n", MOD),
    # Session 16: a report audit on a real 2-seed grid
    ("runs whose MFU divides by different peaks are not named", "analysis/report.py",
     "    if len(peaks) > 1:  # each run's MFU", "    if False:  # each run's MFU", ["tests/test_analysis.py"]),
    # Session 18: a report audit, run.name, a finished rank's exit
    ("a diverged seed (nan eval loss) left out of its variant's mean", "analysis/report.py",
     "        out[m.key] = None if v is None else float(v)",
     "        out[m.key] = None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)",
     ["tests/test_analysis.py"]),
    ("a run far from every named budget put under the nearest", "analysis/isoflop.py",
     "label = [b if abs(math.log(v / b)) <= math.log(1 + rtol) else None for v, b in zip(values, near)]",
     "label = list(near)", ["tests/test_analysis.py"]),
    ("a '/' in run.name accepted (the report's figure path breaks)", "mode/config.py",
     "_check(not self.name or bool(NAME_RE.fullmatch(self.name)),", "_check(True,", CKPT),
    ("runs of different tokenizers tabled side by side without a word", "analysis/report.py",
     "    lines += data_mismatch_lines(runs, runs_dir)\n", "    lines += []\n", ["tests/test_analysis.py"]),
    ("seeds evaluated at different steps shown under one eval step", "analysis/report.py",
     'else str(row["eval_step"]) if len(read) < 2 else f"{read[0]}–{read[-1]}"]', 'else str(row["eval_step"])]',
     ["tests/test_analysis.py"]),
    ("a finished rank leaves its process group to interpreter exit", "mode/train.py",
     "        if dist.is_initialized():\n            dist.destroy_process_group()\n", "        pass\n",
     ["tests/test_faults.py"]),
    ("`--only mod EXP.yaml`: the YAML taken as a variant", "mode/compare.py",
     "    if misplaced and len(yaml) == 1:\n", "    if False:\n", ["tests/test_compare.py"]),
    ("compare overrides out of command-line order (the first of a repeated key wins)", "mode/compare.py",
     "key=lambda w: argv.index(w) if w in argv else len(argv))", "key=lambda w: 0)", ["tests/test_compare.py"]),
    ("a grid's run.dir clash says 'another run.dir' (compare sets it)", "mode/compare.py",
     '.replace("another run.dir", "another --runs-dir")', "", ["tests/test_compare.py"]),
    ("sampling builds the model from an edited config.yaml, not the checkpoint's", "mode/generate.py",
     "        diff = model_diff(trained, cfg) if trained else []  #", "        diff = []  #", GEN),
    ("a sampling-time key (inference capacity) refused like a model key", "mode/generate.py",
     'keep=lambda k: k.startswith("model.") and k not in SAMPLING_FREE)', 'keep=lambda k: k.startswith("model."))', GEN),
    ("a running prepare's scratch removed as a dead one's", "mode/prepare.py",
     "if not m or _alive(int(m.group(1))) or", "if not m or", ["tests/test_data.py"]),
    ("a user's file inside a dead prepare's scratch deleted with it", "mode/prepare.py",
     "if all(BATCH_FILE.fullmatch(f.name) and f.is_file()", "if all(f.is_file()", ["tests/test_data.py"]),
    ("the report names an empty step when no training step was logged", "analysis/report.py",
     '"(step {last_log}, training batches), not the eval batch." if last_log',
     '"(step {last_log}, training batches), not the eval batch." if True', ["tests/test_analysis.py"]),
    ("an export's edited config.yaml is not checked against export.json", "mode/generate.py",
     'check_model(model_record and {"model": model_record}, "the export"', 'check_model(None, "the export"',
     ["tests/test_export.py"]),
    ("the rebuild hint says `--config F`, not the user's config", "mode/errors.py",
     "        line = with_own_config(line, argv)\n", "", ["tests/test_data.py"]),
]


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)


def main() -> int:
    only = sys.argv[1:]
    chosen = [m for m in MUTANTS if not only or any(o in m[0] for o in only)]
    missed = []
    with tempfile.TemporaryDirectory(prefix="mode-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        # The copy's `mode` package shadows the editable install's (PYTHONPATH comes first).
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        for name, rel, old, new, tests in chosen:
            f = tree / rel
            src = f.read_text()
            if src.count(old) != 1:
                print(f"STALE   {name}: the original text occurs {src.count(old)} times in {rel}", flush=True)
                missed.append(name)
                continue
            f.write_text(src.replace(old, new))
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                                    *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
            finally:
                f.write_text(src)
            failed = next((line.split(" - ")[0] for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
            print(f"{'caught' if r.returncode else 'MISSED'}  {name}: {failed or r.stdout.strip().splitlines()[-1]}", flush=True)
            if not r.returncode:
                missed.append(name)
    print(f"\n{len(chosen) - len(missed)} of {len(chosen)} mutants caught" + (f"; missed: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
