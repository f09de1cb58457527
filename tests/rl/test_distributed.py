"""Data-parallel training (torchrun, DDP) on CPU with gloo: the real command end to end, exact resume, an update over
two ranks equal to one over the whole batch, a NaN on one rank stopping both, the loss weights of every objective and
the metric reduction rule."""

import faulthandler
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY_MODEL, metric_lines, tiny_train_config

from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig, get_objective, objective_names
from moe_rl.objectives.common import loss_denominator_count
from moe_rl.rl import distributed
from moe_rl.rl.build import build_model
from moe_rl.rl.probes import ProbeConfig
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import OptimConfig, RolloutConfig
from moe_rl.runs.runlog import read_manifest, read_tables

REPO = Path(__file__).resolve().parents[2]
TINY_ARGS = ["--device", "cpu", "--model.d-model", "48", "--model.n-layers", "2", "--model.n-experts", "4",
             "--model.d-expert", "48", "--model.d-dense", "96", "--rollout.prompts-per-step", "4",
             "--rollout.group-size", "4", "--rollout.sampling.max-new-tokens", "6"]


def _env() -> dict:
    # This checkout's moe_rl, whatever the environment has installed; one thread per rank.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def _torchrun(*args, cwd, timeout=120) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 ...` (torchrun is `python -m torch.distributed.run`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _comparable(lines):
    return [{k: v for k, v in line.items() if not k.startswith("time/") and k != "wall_time"} for line in lines]


# --- the real command -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """Two rollout steps of `moe-rl train` on two ranks, a checkpoint kept after each."""
    cwd = tmp_path_factory.mktemp("ddp")
    out = _torchrun("-m", "moe_rl.cli", "train", "--out-dir", "run", "--total-steps", "2", "--checkpoint-every", "1",
                    "--keep-every", "1", "--log.samples-every", "1", *TINY_ARGS, cwd=cwd)
    assert out.returncode == 0, out.stderr[-8000:]
    return cwd / "run"


def test_torchrun_trains_and_rank_0_logs_each_update_once(ddp_run):
    assert read_manifest(ddp_run)["status"] == "finished"
    lines = metric_lines(ddp_run)
    assert [(line["step"], line["minibatch"], line["update"]) for line in lines] == [
        (step, j, 4 * step + j) for step in range(2) for j in range(4)]
    assert lines[0]["ratio/log_abs_max"] == 0.0  # the first minibatch is on-policy on both ranks
    routing = read_tables(ddp_run, "routing")
    assert not routing.duplicated(["step", "update", "minibatch", "probe", "layer"]).any()
    checkpoint = torch.load(ddp_run / "checkpoints" / "latest.pt", weights_only=True)
    assert checkpoint["world_size"] == 2 and len(checkpoint["generators_by_rank"]) == 2


def _roll_back_to_step_1(run: Path) -> None:
    """As if the run had been killed after step 1: the newer checkpoints moved away (a resume from an older one
    while they remain is refused), the run then continued with --resume-from the step-1 checkpoint."""
    for newer in ("step_000002.pt", "latest.pt"):
        (run / "checkpoints" / newer).unlink()


def test_torchrun_resume_continues_every_rank_exactly(ddp_run, tmp_path):
    resumed = tmp_path / "run"
    shutil.copytree(ddp_run, resumed)
    _roll_back_to_step_1(resumed)
    out = _torchrun("-m", "moe_rl.cli", "train", "--out-dir", "run", "--total-steps", "2", "--checkpoint-every", "1",
                    "--keep-every", "1", "--log.samples-every", "1", "--resume-from",
                    "run/checkpoints/step_000001.pt", *TINY_ARGS, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-8000:]
    assert _comparable(metric_lines(resumed)) == _comparable(metric_lines(ddp_run))  # CPU: bit for bit
    final, again = (torch.load(run / "checkpoints" / "latest.pt", weights_only=True)["model"]
                    for run in (ddp_run, resumed))
    assert all(torch.equal(final[name], again[name]) for name in final)


NAN_ON_RANK_1 = """
    import os, sys
    import moe_rl.rl.trainer as trainer_module
    from moe_rl.cli import main

    if os.environ["RANK"] == "1":
        if sys.argv[1] == "loss":  # a NaN loss on rank 1 whose gradient is finite: only the agreement can see it
            loss = trainer_module.Trainer._loss
            def nan_loss(self, *args):
                total, metrics = loss(self, *args)
                return (total + float("nan") * total.detach() if self.updates == 2 else total), metrics
            trainer_module.Trainer._loss = nan_loss
        else:  # non-finite logits while sampling step 1 on rank 1
            generate_groups, calls = trainer_module.generate_groups, []
            def failing(*args, **kwargs):
                calls.append(args)
                if len(calls) == 2:
                    raise FloatingPointError("the model produced non-finite logits while sampling")
                return generate_groups(*args, **kwargs)
            trainer_module.generate_groups = failing
    sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("where", ["loss", "sampling"])
def test_a_nan_on_one_rank_stops_both_as_diverged(tmp_path, where):
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(textwrap.dedent(NAN_ON_RANK_1))
    started = time.monotonic()
    out = _torchrun(str(script), where, "--out-dir", "run", "--total-steps", "3", *TINY_ARGS, cwd=tmp_path, timeout=90)
    # every rank exits with status 3 (the run diverged), so torchrun fails; rank 0 names the step and the reason
    assert out.returncode != 0 and "diverged at step " in out.stderr and "exitcode: 3" in out.stderr, out.stderr[-8000:]
    assert time.monotonic() - started < 90
    manifest = read_manifest(tmp_path / "run")
    assert manifest["status"] == "diverged"
    lines = metric_lines(tmp_path / "run")
    if where == "loss":
        assert "non-finite loss (nan)" in manifest["reason"]
        assert len(lines) == 3 and math.isnan(lines[-1]["loss/total"]) and math.isfinite(lines[-1]["grad_norm"])
    else:
        assert manifest["reason"].startswith("rank 1: the model produced non-finite logits while sampling at step 1")
        assert len(lines) == 4  # step 0's updates, then nothing


# --- one update over two ranks equals one update over the whole batch ---------------------------------------------

# Adam's first step is lr * g / (|g| + eps). With the default eps it is about lr * sign(g) and would hide a gradient
# off by any positive factor; with eps = 1 >> |g| it is lr * g to within |g|, so a loss normalised wrongly across
# ranks moves the parameters measurably differently. No clipping, no weight decay; lb loss off (its expert fractions
# are per rank by design), z-loss on (weighted by input tokens, so exact).
EQUIVALENCE_OPTIM = OptimConfig(lr=0.1, eps=1.0, grad_clip=0.0)
EQUIVALENCE_MODEL = ModelConfig(**TINY_MODEL, aux_loss_coef=0.0, z_loss_coef=0.01)
# fp32: the two ranks sum their rows' gradients in two parts and DDP adds the parts, so gradients differ from the
# single process by rounding (~1e-7 relative); with updates of ~1e-2 the parameters agree to a few 1e-9 (measured:
# 3.7e-9; 0 for the idle rank). 1e-7 leaves a wide margin and is 10^4 times below the update size asserted below;
# without the loss weights the dapo 5/11 case differs by ~4e-3.
PARAM_ATOL = 1e-7
# (objective, rank 0's rows, rank 1's rows) of the 16-row batch
CASES = [
    ("grpo", range(0, 8), range(8, 16)),  # mean over sequences, equal rows: the plain DDP average is exact
    ("dapo", range(0, 5), range(5, 16)),  # token mean, unequal rows and tokens: exact only with the loss weights
    ("dapo", range(0, 16), range(0)),  # rank 1 has no rows (DAPO dropped its groups): it joins idle
    ("cispo", range(0, 8), range(8, 16)),  # token mean
]


def _equivalence_config(out_dir, objective: str):
    return tiny_train_config(out_dir, total_steps=1, minibatches=1, model=EQUIVALENCE_MODEL, optim=EQUIVALENCE_OPTIM,
                             objective=ObjectiveConfig(name=objective), probes=ProbeConfig(enabled=()),
                             rollout=RolloutConfig(prompts_per_step=4, group_size=4,
                                                   sampling=SamplingConfig(max_new_tokens=6)))


def _fixed_batch(path: Path):
    """16 sampled rows of the tiny model with synthetic advantages (a random init earns no reward to learn from)."""
    from moe_rl.rl.trainer import Trainer

    trainer = Trainer(_equivalence_config(path.parent / "unused", "grpo"), torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch.advantages_B = torch.randn(batch.size, generator=torch.Generator().manual_seed(1))
    torch.save(batch, path)
    return batch


def _train_on(batch, cfg):
    """train(cfg) with every rollout step replaced by `batch`."""
    from moe_rl.commands.train import train
    from moe_rl.rl.trainer import Trainer

    rollout = Trainer.rollout
    Trainer.rollout = lambda self: (batch, {})
    try:
        return train(cfg)
    finally:
        Trainer.rollout = rollout


def _equivalence_worker(rank: int, world: int, tmp: str) -> None:
    faulthandler.enable()  # a crash in the backend prints where each rank was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
        for i, (objective, *rows_by_rank) in enumerate(CASES):
            rows = torch.tensor(list(rows_by_rank[rank]), dtype=torch.long)
            _train_on(batch.rows(rows), _equivalence_config(f"{tmp}/ddp_{i}", objective))
        reduced = distributed.reduce_metrics({"loss": float(rank), "ratio/max": float(rank),
                                              "seq_ratio/min": float(rank), "time/update": float(rank),
                                              **({"eval/reward": 0.5} if rank == 0 else {})})
        if rank == 0:
            Path(f"{tmp}/reduced.json").write_text(json.dumps(reduced))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a worker that succeeded with exit code 0, skipping the interpreter's teardown: gloo's worker threads can
    abort the process there (SIGABRT, "terminate called without an active exception"; seen once in CI after every
    file of the test was written), which would fail a test whose work was done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, args, nprocs: int = 2, timeout: float = 120) -> None:
    """torch.multiprocessing.spawn with a deadline: a hang fails the test instead of blocking it."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"data-parallel workers still running after {timeout} s")


def test_one_update_over_two_ranks_equals_one_update_over_the_whole_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    batch = _fixed_batch(tmp_path / "batch.pt")
    initial = build_model(EQUIVALENCE_MODEL, torch.device("cpu"), seed=0, init_from=None).state_dict()
    _spawn(_equivalence_worker, (2, str(tmp_path)))
    for i, (objective, rank0_rows, rank1_rows) in enumerate(CASES):
        rows = torch.tensor([*rank0_rows, *rank1_rows], dtype=torch.long)
        single = _train_on(batch.rows(rows), _equivalence_config(tmp_path / f"single_{i}", objective))
        one = torch.load(single / "checkpoints" / "latest.pt", weights_only=True)["model"]
        two = torch.load(tmp_path / f"ddp_{i}" / "checkpoints" / "latest.pt", weights_only=True)["model"]
        max_diff = max((one[name] - two[name]).abs().max().item() for name in one)
        update = max((one[name] - initial[name]).abs().max().item() for name in one)
        print(f"{objective} rows {len(rank0_rows)}/{len(rank1_rows)}: max |update| {update:.3g}, "
              f"max |single - DDP| {max_diff:.3g}")
        assert max_diff <= PARAM_ATOL, f"case {i} ({objective}): {max_diff}"
        assert update > 1e4 * PARAM_ATOL  # the update is large enough for a normalisation error to show
    reduced = json.loads((tmp_path / "reduced.json").read_text())
    assert reduced == {"loss": 0.5, "ratio/max": 1.0, "seq_ratio/min": 0.0, "time/update": 1.0, "eval/reward": 0.5}


# --- the pieces, without processes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", objective_names())
def test_loss_shares_make_the_ranks_losses_add_up_to_the_whole_batch_loss(name):
    """sum_r (n_r / N) L_r = L over all rows, value and gradient, with n = the objective's declared denominator: the
    identity that makes DDP's average of the weighted per-rank gradients the whole-batch gradient."""
    g = torch.Generator().manual_seed(0)
    B, T = 10, 7
    mask_BT = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    old_logp_BT = -torch.rand(B, T, generator=g) * 3
    logp_BT = (old_logp_BT + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()  # off-policy: clipping acts
    adv_B = torch.randn(B, generator=g)
    spec = get_objective(name)
    cfg = ObjectiveConfig(name=name, max_response_len=T)  # the trainer always fixes Dr. GRPO's L_max
    whole, _ = spec(logp_BT, old_logp_BT, adv_B, mask_BT, cfg)
    shards = [torch.arange(0, 3), torch.arange(3, B)]
    count = lambda rows: loss_denominator_count(spec.loss_denominator, mask_BT[rows])  # noqa: E731
    weighted = sum(count(rows) / count(torch.arange(B)) * spec(logp_BT[rows], old_logp_BT[rows], adv_B[rows],
                                                               mask_BT[rows], cfg)[0] for rows in shards)
    assert weighted.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-6)
    (grad_whole,) = torch.autograd.grad(whole, logp_BT)
    (grad_weighted,) = torch.autograd.grad(weighted, logp_BT)
    torch.testing.assert_close(grad_weighted, grad_whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name, rule", [
    ("ratio/max", "max"), ("ratio/log_abs_max", "max"), ("seq_ratio/max", "max"), ("time/update", "max"),
    ("ratio/min", "min"), ("seq_ratio/min", "min"),
    ("loss", "mean"), ("clip_ratio/low_mean", "mean"), ("routing/update/churn/L1", "mean"), ("kl", "mean"),
    ("completions/clipped_ratio", "mean"), ("routing/load_cv", "mean"),
])
def test_reduction_rule(name, rule):
    assert distributed.reduction(name) == rule


def test_a_single_process_needs_no_process_group():
    assert not distributed.active() and distributed.world_size() == 1 and distributed.is_main()
    metrics = {"loss": 1.0, "ratio/max": 2.0}
    assert distributed.reduce_metrics(metrics) == metrics and distributed.all_true(True)
    model = torch.nn.Linear(2, 2)
    assert distributed.data_parallel(model, torch.device("cpu")) is model


def test_prompts_per_step_must_split_evenly_over_the_ranks(tmp_path):
    cfg = tiny_train_config(tmp_path, minibatches=8)  # 4 prompts x 4 completions
    cfg.check_data_parallel(2)  # 8 rows per rank
    with pytest.raises(ConfigError, match="prompts_per_step=4 must be divisible by the number of data-parallel"):
        cfg.check_data_parallel(3)
    with pytest.raises(ConfigError, match="minibatches=8 must divide each rank's rollout rows"):
        cfg.check_data_parallel(4)  # 4 rows per rank


@pytest.mark.slow
def test_torchrun_runs_the_smoke_experiment_from_its_config_file(tmp_path):
    """The smoke experiment's first run, saved as JSON, launched on two gloo ranks through --config-file."""
    from moe_rl.experiments.smoke import smoke
    from moe_rl.rl.overrides import with_overrides
    from moe_rl.runs.runlog import config_to_dict

    experiment = smoke()
    cfg = with_overrides(experiment.base, experiment.grid[0])
    (tmp_path / "smoke.json").write_text(json.dumps(config_to_dict(cfg)))
    out = _torchrun("-m", "moe_rl.cli", "train", "--config-file", "smoke.json", "--out-dir", "run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-8000:]
    assert read_manifest(tmp_path / "run")["status"] == "finished"
    lines = metric_lines(tmp_path / "run")
    assert len(lines) == cfg.total_steps * cfg.minibatches
    assert json.loads((tmp_path / "run" / "config.json").read_text())["objective"]["name"] == cfg.objective.name


def test_a_run_that_does_not_shard_never_imports_fsdp_or_its_state_dict_helpers():
    """Together they cost about 2 s of start-up per process (a third of a training run's on a 2-core EPYC), and
    every run, sweep worker and CLI call used to pay it. is_sharded must still answer without the import."""
    code = textwrap.dedent("""
        import json, sys
        import moe_rl.rl.trainer, moe_rl.commands.sft, moe_rl.sweep.command
        from moe_rl.rl.distributed import is_sharded
        from conftest import tiny_model
        assert not is_sharded(tiny_model())
        heavy = [name for name in ("torch.distributed.fsdp", "torch.distributed.checkpoint", "pandas")
                 if name in sys.modules]
        print(json.dumps(heavy))
    """)
    tests = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tests,
                         env={**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"})
    assert out.returncode == 0, out.stderr
    # pandas comes with the sweep's index (moe_rl.sweep.jobs); only the FSDP modules must be absent
    assert [name for name in json.loads(out.stdout) if name != "pandas"] == []
