"""FSDP2 (`--parallel fsdp2`) on CPU with gloo: one sharded update over two ranks equals the single-process update
and its probes read what DDP's read, R2 replay on the sharded model reproduces the old pass's log-probs (and a
shifted routing changes them while the router keeps its gradient), ranks sample different lengths on it, the real
command trains with every probe and checkpoints whole tensors, and a resume continues bit for bit."""

import faulthandler
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import metric_lines
from test_distributed import (
    EQUIVALENCE_MODEL,
    PARAM_ATOL,
    TINY_ARGS,
    _equivalence_config,
    _fixed_batch,
    _spawn,
    _torchrun,
    _train_on,
    exit_without_teardown,
)

from moe_rl.errors import ConfigError
from moe_rl.objectives import ObjectiveConfig
from moe_rl.rl import distributed
from moe_rl.rl.build import build_model
from moe_rl.rl.policy import policy_forward
from moe_rl.rl.probes import ProbeConfig
from moe_rl.rl.rollout import SamplingConfig, generate
from moe_rl.routing.replay import record_routing
from moe_rl.routing.trace import RoutingTrace
from moe_rl.runs.runlog import read_manifest, read_tables

ROWS = (range(8), range(8, 16))  # rank 0's and rank 1's rows of the 16-row batch


def _probed_config(out_dir, parallel: str):
    return replace(_equivalence_config(out_dir, "grpo"), parallel=parallel, probes=ProbeConfig())


def _replay_check(batch, rows) -> dict:
    """On a sharded model: the old pass's routing replayed gives its log-probs exactly; a shifted routing changes
    them, and the router still gets a gradient through the sharded parameters."""
    model = distributed.shard_fsdp2(build_model(EQUIVALENCE_MODEL, torch.device("cpu"), seed=0, init_from=None))
    with torch.no_grad():
        old = policy_forward(model, rows, 1.0, record=True)
        again = policy_forward(model, rows, 1.0, replay=old.trace)
    shifted = RoutingTrace((old.trace.ids_LBSK + 1) % EQUIVALENCE_MODEL.n_experts)
    out = policy_forward(model, rows, 1.0, replay=shifted)
    (out.logp_BN * rows.response_mask_BN).sum().backward()
    router_grad = model.blocks[0].ffn.router.gate.weight.grad
    return {**_sampling_check(model, rows),"replay_equal": torch.equal(again.logp_BN, old.logp_BN),
            "shifted_diff": (out.logp_BN.detach() - old.logp_BN).abs().max().item(),
            "router_grad_norm": distributed.scalar(router_grad.norm())}


def _sampling_check(model, rows) -> dict:
    """Ranks sampling different numbers of tokens on the sharded model (inside full_parameters), the sampler's
    stitched routing equal to a sharded full forward's."""
    rank = dist.get_rank()
    prompt_BP = rows.input_ids_BS[:4, :rows.prompt_len]
    valid_BP = rows.input_valid_BS[:4, :rows.prompt_len]
    with torch.no_grad(), distributed.full_parameters(model):
        gen = generate(model, prompt_BP, valid_BP, SamplingConfig(max_new_tokens=2 + 3 * rank), eos_id=-1, pad_id=0,
                       generator=torch.Generator().manual_seed(rank), record=True)
    with torch.no_grad(), record_routing(model) as recorder:
        model(gen.input_ids_BS, gen.input_valid_BS)
    return {"sampled": gen.response_BN.shape[1], "stitched_equal": torch.equal(gen.routing.ids_LBSK,
                                                                               recorder.trace().ids_LBSK)}


def _fsdp_worker(rank: int, world: int, tmp: str) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
        rows = batch.rows(torch.tensor(list(ROWS[rank]), dtype=torch.long))
        _train_on(rows, _probed_config(f"{tmp}/fsdp2", "fsdp2"))
        _train_on(rows, _probed_config(f"{tmp}/ddp", "ddp"))  # the same update, replicated: probes must agree
        Path(f"{tmp}/replay_{rank}.json").write_text(json.dumps(_replay_check(batch, rows)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def test_one_fsdp2_update_over_two_ranks_equals_the_single_process_update(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    batch = _fixed_batch(tmp_path / "batch.pt")
    initial = build_model(EQUIVALENCE_MODEL, torch.device("cpu"), seed=0, init_from=None).state_dict()
    _spawn(_fsdp_worker, (2, str(tmp_path)))
    single = _train_on(batch.rows(torch.arange(16)), _probed_config(tmp_path / "single", "ddp"))
    one = torch.load(single / "checkpoints" / "latest.pt", weights_only=True)["model"]
    two = torch.load(tmp_path / "fsdp2" / "checkpoints" / "latest.pt", weights_only=True)
    assert two["parallel"] == "fsdp2" and two["world_size"] == 2
    assert {name: t.shape for name, t in two["model"].items()} == {name: t.shape for name, t in one.items()}
    max_diff = max((one[name] - two["model"][name]).abs().max().item() for name in one)
    update = max((one[name] - initial[name]).abs().max().item() for name in one)
    print(f"FSDP2 grpo rows 8/8: max |update| {update:.3g}, max |single - FSDP2| {max_diff:.3g}")
    assert max_diff <= PARAM_ATOL and update > 1e4 * PARAM_ATOL
    (fsdp2_line,), (ddp_line,) = metric_lines(tmp_path / "fsdp2"), metric_lines(tmp_path / "ddp")
    routing = {k: v for k, v in fsdp2_line.items() if k.startswith("routing/")}
    assert routing == {k: v for k, v in ddp_line.items() if k.startswith("routing/")}
    assert routing["routing/update/churn"] > 0 and routing["routing/noise/churn"] == 0.0
    assert fsdp2_line["update/kl"] == pytest.approx(ddp_line["update/kl"], rel=1e-4)
    for rank in range(2):
        replay = json.loads((tmp_path / f"replay_{rank}.json").read_text())
        assert replay["replay_equal"] and replay["shifted_diff"] > 1e-3 and replay["router_grad_norm"] > 0
        assert replay["sampled"] == 2 + 3 * rank and replay["stitched_equal"]


FSDP2_ARGS = ["--out-dir", "run", "--total-steps", "2", "--minibatches", "2", "--checkpoint-every", "1",
              "--keep-every", "1", "--parallel", "fsdp2", "--routing-mode", "R2", "--log.eval-every", "1",
              "--log.eval-prompts", "8", *TINY_ARGS]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("fsdp2")
    out = _torchrun("-m", "moe_rl.cli", "train", *FSDP2_ARGS, cwd=cwd)
    assert out.returncode == 0, out.stderr[-8000:]
    return cwd / "run"


def test_torchrun_fsdp2_trains_with_every_probe_and_saves_whole_tensors(fsdp2_run):
    assert read_manifest(fsdp2_run)["status"] == "finished"
    lines = metric_lines(fsdp2_run)
    updates = [line for line in lines if line["minibatch"] >= 0]
    assert [line["update"] for line in updates] == list(range(4))
    for line in updates:
        assert {"routing/update/churn", "routing/update/churn/L1", "routing/staleness/churn",
                "routing/replay/churn"} <= set(line)
    first = [line for line in updates if line["minibatch"] == 0]
    # R2 on theta_old through the sharded training forward: ratio 1 and replayed ids = native top-k, exactly
    assert all(line["ratio/log_abs_max"] == 0.0 and line["routing/replay/churn"] == 0.0 for line in first)
    assert all(line["routing/noise/churn"] == 0.0 for line in first)  # two forwards of the sharded model agree
    assert sum(line["routing/update/churn"] for line in updates) > 0
    assert any("eval/reward" in line for line in lines)
    assert set(read_tables(fsdp2_run, "routing")["probe"]) == {"update", "staleness", "replay", "rollout", "noise"}
    checkpoint = torch.load(fsdp2_run / "checkpoints" / "latest.pt", weights_only=True)
    assert checkpoint["model"]["embed.weight"].shape == (99, 48)  # whole, not a rank's shard
    assert type(checkpoint["model"]["embed.weight"]) is torch.Tensor


def test_torchrun_fsdp2_resume_continues_exactly(fsdp2_run, tmp_path):
    resumed = tmp_path / "run"
    shutil.copytree(fsdp2_run, resumed)
    for newer in ("step_000002.pt", "latest.pt"):  # as if killed after step 1 (see test_distributed.py)
        (resumed / "checkpoints" / newer).unlink()
    out = _torchrun("-m", "moe_rl.cli", "train", *FSDP2_ARGS, "--resume-from", "run/checkpoints/step_000001.pt",
                    cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-8000:]
    strip = lambda lines: [{k: v for k, v in line.items() if not k.startswith("time/") and k != "wall_time"}
                           for line in lines]
    assert strip(metric_lines(resumed)) == strip(metric_lines(fsdp2_run))
    final, again = (torch.load(run / "checkpoints" / "latest.pt", weights_only=True)["model"]
                    for run in (fsdp2_run, resumed))
    assert all(torch.equal(final[name], again[name]) for name in final)


def test_fsdp2_refuses_objectives_that_drop_groups_and_is_a_no_op_alone(tmp_path):
    cfg = replace(_equivalence_config(tmp_path, "dapo"), parallel="fsdp2")
    cfg.check_data_parallel(1)
    with pytest.raises(ConfigError, match="objective.name='dapo' drops groups"):
        cfg.check_data_parallel(2)
    replace(cfg, objective=ObjectiveConfig(name="grpo")).check_data_parallel(2)
    model = torch.nn.Linear(2, 2)
    assert distributed.parallelize(model, torch.device("cpu"), "fsdp2") is model
    with pytest.raises(ConfigError, match="parallel='zero3' is not valid"):
        replace(cfg, parallel="zero3")
