"""Checkpoints: atomic saves, kept copies, exact resume of model, optimizer, scheduler and every RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moe_rl.runs.atomic import iter_temp_files
from moe_rl.runs.checkpoint import (
    NoCheckpointError,
    capture_rng_state,
    load_checkpoint,
    load_latest,
    restore_rng_state,
    restore_training_state,
    save_checkpoint,
    training_state,
)


def make_trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, generator):
    """One update whose data depends on every RNG source, so any unrestored state changes the result."""
    x = torch.randn(8, 4, generator=generator) + torch.rand(1) + random.random() + float(np.random.rand())
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def seed_everything(seed: int, generator: torch.Generator) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    generator.manual_seed(seed)


def test_round_trip_continues_exactly_as_without_the_stop(tmp_path):
    data_rng = torch.Generator().manual_seed(0)
    seed_everything(0, data_rng)
    model, optimizer, scheduler = make_trainer(seed=0)
    for _ in range(3):
        train_step(model, optimizer, scheduler, data_rng)
    state = training_state(model, optimizer, scheduler=scheduler, data_position=24, generators={"data": data_rng})
    save_checkpoint(tmp_path, step=3, state=state)
    uninterrupted = [train_step(model, optimizer, scheduler, data_rng) for _ in range(2)]
    expected_weight = model.weight.detach().clone()

    # A fresh process: different weights, different RNG states, until the checkpoint is restored.
    seed_everything(123, data_rng)
    model, optimizer, scheduler = make_trainer(seed=1)
    loaded = load_latest(tmp_path)
    step = restore_training_state(loaded, model, optimizer, scheduler=scheduler, generators={"data": data_rng})
    assert (step, loaded["data_position"]) == (3, 24)
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    resumed = [train_step(model, optimizer, scheduler, data_rng) for _ in range(2)]
    assert resumed == uninterrupted
    assert torch.equal(model.weight, expected_weight)


def test_rng_state_restores_every_source_and_named_generator():
    sampler = torch.Generator().manual_seed(5)
    state = capture_rng_state({"sampler": sampler})

    def draw():
        return (random.random(), float(np.random.rand()), torch.rand(3).tolist(),
                torch.rand(2, generator=sampler).tolist())

    first = draw()
    restore_rng_state(state, {"sampler": sampler})
    assert draw() == first


def test_restoring_without_a_saved_generator_names_it():
    state = capture_rng_state({"sampler": torch.Generator()})
    with pytest.raises(ValueError, match=r"\['sampler'\].*\['data'\]"):
        restore_rng_state(state, {"data": torch.Generator()})


def test_kept_copies_every_n_steps_survive_later_saves(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"weights": torch.full((2,), float(step))}, keep_every=2)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest.pt", "step_000002.pt", "step_000004.pt"]
    assert load_latest(tmp_path)["step"] == 5
    kept = load_checkpoint(folder / "step_000002.pt")
    assert kept["step"] == 2 and kept["weights"].tolist() == [2.0, 2.0]
    assert list(iter_temp_files(tmp_path)) == []


def test_save_refuses_a_state_with_another_step(tmp_path):
    with pytest.raises(ValueError, match="step is 4"):
        save_checkpoint(tmp_path, 5, {"step": 4})


def test_load_latest_without_a_checkpoint_names_the_directory(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(NoCheckpointError, match=rf"{tmp_path / 'run'}.*no checkpoints/latest\.pt"):
        load_latest(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_latest(tmp_path / "missing")
