"""Router learning rate: frozen routers (scale 0) never change and leave the gradient norm, a scale moves the
routers by that multiple of the rest, and a bad scale is refused."""

import pytest
import torch
from conftest import metric_lines, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.rl.build import router_parameters
from moe_rl.rl.run_config import OptimConfig
from moe_rl.rl.trainer import Trainer


def _one_rollout_step(tmp_path, scale):
    trainer = Trainer(tiny_train_config(tmp_path, optim=OptimConfig(lr=1e-3, warmup_steps=0, router_lr_scale=scale)),
                      torch.device("cpu"))
    routers = {id(p) for p in router_parameters(trainer.model)}
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.rl_step(lambda line: None)
    moved = {name: (p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters()}
    is_router = {name: id(p) in routers for name, p in trainer.model.named_parameters()}
    return trainer, moved, is_router


def test_frozen_routers_never_change_while_the_rest_trains(tmp_path):
    trainer, moved, is_router = _one_rollout_step(tmp_path, 0.0)
    assert any(is_router.values())
    assert all(moved[name] == 0.0 for name in moved if is_router[name])
    assert max(moved[name] for name in moved if not is_router[name]) > 1e-4
    assert all(not p.requires_grad for p in router_parameters(trainer.model))
    assert all(id(p) not in {id(q) for q in router_parameters(trainer.model)}
               for group in trainer.optimizer.param_groups for p in group["params"])


@pytest.mark.parametrize("scale", [0.1, 10.0])
def test_router_lr_scale_moves_the_routers_by_that_multiple(tmp_path, scale):
    trainer, moved, is_router = _one_rollout_step(tmp_path, scale)
    assert [group["lr"] for group in trainer.optimizer.param_groups] == pytest.approx([1e-3, 1e-3 * scale])
    # Adam's steps are about lr per element whatever the gradient's size, so the largest moves scale with the lr
    router_move = max(moved[name] for name in moved if is_router[name])
    other_move = max(moved[name] for name in moved if not is_router[name])
    assert 0.5 * scale < router_move / other_move < 2 * scale


def test_frozen_routers_still_churn_at_a_high_lr(tmp_path):
    lines = metric_lines(train(tiny_train_config(tmp_path, total_steps=2,
                                                 optim=OptimConfig(lr=3e-3, router_lr_scale=0.0))))
    assert max(line["routing/update/set_change"] for line in lines) > 0


def test_negative_router_lr_scale_is_refused():
    with pytest.raises(ConfigError, match="router_lr_scale"):
        OptimConfig(router_lr_scale=-1.0)
