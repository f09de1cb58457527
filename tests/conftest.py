"""Shared test set-up: one torch thread (small tensors are much faster that way on these machines), seeds,
and tiny model factories."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from moe_rl.model import ModelConfig, MoETransformer  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64,
                n_experts=6, top_k=2, d_expert=24, d_dense=48, init_std=0.1)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    """A tiny native model with this machine's kernels, as moe_rl/rl/build.py builds every model."""
    from moe_rl import kernels

    torch.manual_seed(seed)
    return MoETransformer(tiny_config(**overrides), kernels=kernels.machine())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _kernel_choice_made_before_any_test():
    """On a machine's first use the kernel families are measured (moe_rl/kernels/measure.py), which calls the model's
    replaceable functions hundreds of times: done here, before any test, so that no test that replaces or counts
    one of them sees the measurement's calls (on a fresh machine it would fall inside whichever test came first)."""
    from moe_rl import kernels

    kernels.choices()


# --- tiny RL runs -----------------------------------------------------------------------------------------

TINY_MODEL = dict(d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=48, d_dense=96)


def tiny_train_config(out_dir, **overrides):
    """A TrainConfig that runs a rollout step in well under a second on one CPU thread."""
    from moe_rl.model import ModelConfig
    from moe_rl.rl.rollout import SamplingConfig
    from moe_rl.rl.run_config import OptimConfig, RolloutConfig, TrainConfig

    base = dict(
        out_dir=str(out_dir), total_steps=3, model=ModelConfig(**TINY_MODEL),
        rollout=RolloutConfig(prompts_per_step=4, group_size=4, sampling=SamplingConfig(max_new_tokens=6)),
        optim=OptimConfig(lr=3e-4),
    )
    base.update(overrides)
    return TrainConfig(**base)


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory):
    """A warm-started tiny model (about 0.2 mean reward on chain_sum), shared by the tests that need one."""
    from moe_rl.commands.sft import sft
    from moe_rl.model import ModelConfig
    from moe_rl.rl.rollout import SamplingConfig
    from moe_rl.rl.run_config import SFTConfig, SFTLogConfig

    out = tmp_path_factory.mktemp("sft") / "run"
    sft(SFTConfig(out_dir=str(out), total_steps=300, batch_size=64, model=ModelConfig(**TINY_MODEL),
                  log=SFTLogConfig(eval_every=1000, eval_prompts=64), sampling=SamplingConfig(max_new_tokens=6)))
    return out / "checkpoints" / "latest.pt"


def metric_lines(run_dir, minibatch=None):
    """metrics.jsonl lines of a run, optionally only those of one minibatch index."""
    from moe_rl.runs.runlog import read_metrics

    lines = read_metrics(run_dir)
    return [line for line in lines if minibatch is None or line.get("minibatch") == minibatch]


@pytest.fixture
def kernels_on():
    """Every kernel family on, whatever this machine's measurement chose: for the tests of the kernels themselves
    (a family the measurement turned off here must still give its reference's numbers on the machines where it
    runs)."""
    from moe_rl import kernels

    with kernels.forced(**{family: True for family in kernels.FAMILIES}):
        yield


def switch_kernels_off(monkeypatch) -> None:
    """Every kernel family off for the rest of the test: the torch reference everywhere, as on a machine without
    a C compiler."""
    from moe_rl.kernels import selection

    monkeypatch.setattr(selection, "_forced", {**selection._forced, **{f: False for f in selection.FAMILIES}})


def spy_kernel(monkeypatch, op: str) -> list:
    """A list that gets one entry per call the fast implementation of `op` served (moe_rl/kernels/registry.py)."""
    import functools

    from moe_rl.kernels.registry import IMPLEMENTATIONS

    fast, served = IMPLEMENTATIONS[op], []

    @functools.wraps(fast)  # keeps its signature: the kernel set hands itself to those that take `kernels`
    def counted(*args, **kwargs):
        out = fast(*args, **kwargs)
        if out is not NotImplemented:
            served.append(1)
        return out

    monkeypatch.setitem(IMPLEMENTATIONS, op, counted)
    return served


def sample_and_refit(precision: str):
    """(churn stats, mean |log p_sampler - log p_trainer|) between the sampler in `precision` and an fp32 full
    forward of the same tokens, on a tiny 16-expert model."""
    from moe_rl.rl.rollout import SamplingConfig, generate
    from moe_rl.routing.churn import churn_stats
    from moe_rl.routing.replay import record_routing

    model = tiny_model(n_experts=16, top_k=4).eval()
    ids = torch.randint(3, 40, (32, 6), generator=torch.Generator().manual_seed(0))
    valid = torch.ones_like(ids, dtype=torch.bool)
    cfg = SamplingConfig(max_new_tokens=12, precision=precision)
    out = generate(model, ids, valid, cfg, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(1),
                   record=True)
    with torch.no_grad(), record_routing(model) as rec:
        logits = model(out.input_ids_BS, out.input_valid_BS).logits_BSV
    logp = logits[:, out.prompt_len - 1:].log_softmax(-1).gather(-1, out.response_BN[..., None]).squeeze(-1)
    mask = out.response_mask_BN
    return churn_stats(rec.trace(), out.routing, out.input_valid_BS), (logp - out.logprobs_BN)[mask].abs().mean()


# --- the CLI in this process -------------------------------------------------------------------------------


def cli(*argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `moe-rl argv` through the entry point, in this process."""
    import contextlib
    import io

    from moe_rl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def refused(result, *named: str) -> str:
    """The one line of a refusal (exit 2, no traceback) from `cli`, checked to contain each of `named`."""
    code, out, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, (code, err)
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]
