"""Run configs: one dataclass per concern, nested into `TrainConfig` (RL) and `SFTConfig` (warm start).

tyro turns the docstring under each field into `--help`, so this file is the reference for every knob.
Validation happens at construction; a bad value names its field and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from moe_rl.errors import ConfigError, check_choice, check_finite_fields, check_positive
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig, get_objective
from moe_rl.rl.correction import CorrectionConfig
from moe_rl.rl.distributed import PARALLEL_MODES
from moe_rl.rl.engines import ENGINES, check_engine_config
from moe_rl.rl.probes import ProbeConfig
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.routing.mode import MODE_NAMES, ModeName, RoutingMode
from moe_rl.routing.replay import ReplayConfig
from moe_rl.tasks import TaskConfig

Device = Literal["auto", "cpu", "cuda"]
TrackerName = Literal["tensorboard", "wandb"]
ROUTING_MODES, DEVICES = MODE_NAMES, get_args(Device)


def check_out_dir_named(config) -> None:
    """`--out-dir ''` would put the run into the working directory: refused (None, the default, names a new one)."""
    if config.out_dir is not None and not config.out_dir.strip():
        raise ConfigError(f"out_dir={config.out_dir!r} is empty: give the run's directory (e.g. --out-dir "
                          "runs/<name>), or leave the flag out for a new runs/<time>-<name>")


def check_numbers(config) -> None:
    """What every command's config passes before anything else: no NaN or Inf in any float field (each named by its
    dotted path), and a rotary base > 0 (theta = 0 gives NaN angles, reported much later as a divergence)."""
    check_finite_fields(config)
    check_positive("model.rope_theta", config.model.rope_theta)


@dataclass
class OptimConfig:
    """AdamW with linear warmup to a constant learning rate, and gradient-norm clipping."""

    lr: float = 5e-5
    """Peak learning rate. 5e-5 keeps the CPU models' policy intact (1e-4 and above lost 0.1 held-out reward within
    10 rollout steps from a warm start in the objective_comparison search; 1e-3 wrecks it)."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup from 0 to lr; constant afterwards."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    router_lr_scale: float = 1.0
    """The routers' learning rate as a multiple of lr. 0 freezes them (no gradient, no update, left out of the
    gradient norm): routing then moves only because the hidden states feeding the routers move."""

    def __post_init__(self) -> None:
        check_adamw(self)
        check_positive("router_lr_scale", self.router_lr_scale, allow_zero=True)


def check_adamw(cfg) -> None:
    """The AdamW fields train's and sft's optimizer configs share: lr > 0, the rest >= 0, betas in [0, 1)."""
    check_positive("lr", cfg.lr)
    for name in ("warmup_steps", "weight_decay", "grad_clip"):
        check_positive(name, getattr(cfg, name), allow_zero=True)
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be in [0, 1)")


@dataclass
class RolloutConfig:
    """How many completions each rollout step samples, and how."""

    prompts_per_step: int = 16
    """Prompts per rollout step (B); the rollout batch holds B x G completions."""
    group_size: int = 8
    """Completions per prompt (G), the group whose rewards normalise the advantage."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: Literal[ENGINES] = "native"  # the tuple spells the choices; --help lists them
    """What samples the rollouts (moe_rl.rl.engines): 'native', moe-rl's KV-cached sampler on the trainer's model;
    'vllm', a vLLM engine loaded from the trainer's Hugging Face model (--model.backend hf, or the native model's
    exact Mixtral export) and synced after each optimizer step, its routing captured for R3; needs the optional vLLM
    install (README)."""

    def __post_init__(self) -> None:
        check_positive("prompts_per_step", self.prompts_per_step)
        check_choice("rollout.engine", self.engine, ENGINES)
        if self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size} must be >= 2: group-normalised advantages need a group")
        if self.engine == "vllm" and self.sampling.min_new_tokens:
            raise ConfigError("rollout.sampling.min_new_tokens is not passed to the vLLM engine (whether its "
                              "log-probs then score the banned distribution is untested); use --rollout.engine native")


@dataclass
class WandbConfig:
    """Where `--log.trackers wandb` puts the run; a resumed run continues the same W&B run (its id is kept in
    manifest.json)."""

    project: str = "moe-rl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None = your default entity."""
    group: str | None = None
    """W&B group; `moe-rl sweep` sets it to the sweep's name, so a sweep's runs show together."""


@dataclass
class LogConfig:
    """What is written to the run directory besides metrics.jsonl."""

    samples_every: int = 10
    """Write prompts, completions and rewards to samples/ every n-th rollout step; 0 disables."""
    samples_per_step: int = 16
    """How many completions each samples/ table keeps."""
    eval_every: int = 0
    """Evaluate mean reward on the held-out split every n-th rollout step (and at the end); 0 disables."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation (sampled at the training temperature, and greedily)."""
    eval_samples: int = 1
    """Sampled completions per held-out prompt for eval/reward; its SE counts prompts, not samples."""
    eval_greedy: bool = True
    """Also log greedy (argmax) accuracy on the same prompts, eval/greedy (one more decode per evaluation)."""
    trackers: tuple[TrackerName, ...] = ()
    """Optional mirrors of the metrics: 'tensorboard' and/or 'wandb' (needs `pip install 'moe-rl[tracking]'`)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    warn_threshold: float | None = None
    """Early warning: print one line (and note it in manifest.json) the first time warn_metric reaches this value on
    an optimizer step's line, e.g. a threshold fitted by `moe-rl early-warning`; None = off. Changes no number."""
    warn_metric: str = "routing/update/set_change"
    """The metric the early warning watches, as logged in metrics.jsonl (docs/metrics.md)."""

    def __post_init__(self) -> None:
        if self.warn_threshold is not None and not self.warn_metric.strip():
            raise ConfigError("log.warn_metric is empty: name the metric log.warn_threshold applies to")
        for name in ("samples_every", "samples_per_step", "eval_every"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_positive("eval_prompts", self.eval_prompts)
        check_positive("eval_samples", self.eval_samples)
        for tracker in self.trackers:
            check_choice("trackers", tracker, ("tensorboard", "wandb"))


@dataclass
class TrainConfig:
    """One RL run: a task with verifiable rewards, an objective and a routing mode on the native MoE model."""

    out_dir: str | None = None
    """Run directory (config.json, manifest.json, metrics.jsonl, routing/, samples/, checkpoints/); None = a new
    runs/<UTC time>-<objective>-<routing mode>."""
    seed: int = 0
    """Seeds model init (without init_from), sampling, minibatch shuffling and probe subsampling."""
    total_steps: int = 50
    """Rollout steps; each makes `minibatches` optimizer steps."""
    minibatches: int = 4
    """Optimizer steps per rollout batch; the paper's 4 makes 3 of 4 updates off-policy."""
    routing_mode: ModeName = "native"
    """native: routers choose freely; R2: replay the old pass's routing in every update; R3: replay the
    sampler's routing in the old pass and in every update."""
    kl_coef: float = 0.0
    """Coefficient of a k3 KL penalty to the frozen initial policy (0 = none, the paper's default)."""
    init_from: str | None = None
    """Checkpoint to start from (e.g. the SFT warm start, runs/sft/checkpoints/latest.pt); None = random init."""
    resume: bool = False
    """Continue the run in out_dir from its latest checkpoint. A run that saved no checkpoint starts over, with or
    without --resume (unless it finished or diverged)."""
    resume_from: str | None = None
    """Continue the run from one of its own kept checkpoints (out_dir/checkpoints/step_XXXXXX.pt) instead of
    latest.pt, e.g. after latest.pt was deleted; out_dir defaults to the run holding it. Refused while a newer
    checkpoint is in the directory."""
    checkpoint_every: int = 25
    """Save checkpoints/latest.pt every n rollout steps (and at the end)."""
    keep_every: int | None = None
    """Also keep a copy checkpoints/step_XXXXXX.pt every n rollout steps; None keeps only the latest."""
    device: Device = "auto"
    """auto (cuda if available), cpu or cuda. On cuda the model runs under bf16 autocast; on cpu in fp32."""
    threads: int = 1
    """torch CPU threads; 1 is fastest for tiny models on small machines (docs/performance.md, "Threads")."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun: 'ddp' replicates the model on every rank; 'fsdp2' shards parameters, gradients and optimizer
    state over the ranks (fully_shard per decoder block). No effect in a single process."""
    quiet: bool = False
    """Print no progress line per rollout step (a divergence is still reported)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def routing(self) -> RoutingMode:
        """The routing mode as the object the trainer asks (checks the mode and the replay variants together)."""
        return RoutingMode.of(self.routing_mode, self.replay)

    def __post_init__(self) -> None:
        check_out_dir_named(self)
        check_numbers(self)
        check_choice("routing_mode", self.routing_mode, ROUTING_MODES)
        check_choice("device", self.device, DEVICES)
        check_choice("parallel", self.parallel, PARALLEL_MODES)
        for name in ("total_steps", "minibatches", "checkpoint_every", "threads"):
            check_positive(name, getattr(self, name))
        check_positive("kl_coef", self.kl_coef, allow_zero=True)
        if self.keep_every is not None:
            check_positive("keep_every", self.keep_every)
        check_engine_config(self.rollout.engine, self.rollout.sampling, self.model, self.replay.gate_weights)
        rollout_rows = self.rollout.prompts_per_step * self.rollout.group_size
        if rollout_rows % self.minibatches:
            raise ConfigError(
                f"minibatches={self.minibatches} must divide the rollout batch "
                f"prompts_per_step x group_size = {rollout_rows}"
            )

    def check_data_parallel(self, ranks: int) -> None:
        """Refuse a rollout that does not split evenly over `ranks` data-parallel ranks (torchrun processes)."""
        if self.rollout.prompts_per_step % ranks:
            raise ConfigError(
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} must be divisible by the number of "
                f"data-parallel ranks ({ranks}): every rank samples an equal share of each step's prompts"
            )
        if self.parallel == "fsdp2" and ranks > 1 and get_objective(self.objective.name).drop_zero_std_groups:
            raise ConfigError(
                f"objective.name={self.objective.name!r} drops groups, so ranks can be left with fewer minibatches "
                "than others; under parallel='fsdp2' every rank must run the same forwards. Use parallel='ddp'"
            )
        rank_rows = self.rollout.prompts_per_step // ranks * self.rollout.group_size
        if rank_rows % self.minibatches:
            raise ConfigError(
                f"minibatches={self.minibatches} must divide each rank's rollout rows "
                f"prompts_per_step / ranks x group_size = {rank_rows} ({ranks} ranks)"
            )


@dataclass
class SFTOptimConfig:
    """The warm start's AdamW: linear warmup, then cosine decay to 10% of lr (not train's constant rate), with
    gradient-norm clipping. Train's --optim.* names for the fields the two share, with the warm start's defaults; its
    own class, so that an optimizer option of train's that sft does not apply never appears as an sft flag."""

    lr: float = 3e-3
    """Peak learning rate (linear warmup, then cosine decay to 10%)."""
    warmup_steps: int = 20
    """Optimizer steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        check_adamw(self)


@dataclass
class SFTLogConfig:
    """What the warm start measures and prints besides metrics.jsonl (train's --log.* names)."""

    eval_every: int = 50
    """Measure sampled reward on held-out prompts every n steps (and at the end)."""
    eval_prompts: int = 128
    """Held-out prompts per evaluation."""
    print_every: int = 10
    """Print a progress line every n steps (and at the end)."""
    trackers: tuple[TrackerName, ...] = ()
    """Optional mirrors of the metrics: 'tensorboard' and/or 'wandb' (needs `pip install 'moe-rl[tracking]'`)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        for name in ("eval_every", "eval_prompts", "print_every"):
            check_positive(name, getattr(self, name))
        for tracker in self.trackers:
            check_choice("trackers", tracker, ("tensorboard", "wandb"))


# sft's flags before it took train's names: each old spelling is refused with the new one (moe_rl/cli.py).
SFT_RENAMED_FLAGS = {
    "--steps": "--total-steps", "--lr": "--optim.lr", "--warmup-steps": "--optim.warmup-steps",
    "--weight-decay": "--optim.weight-decay", "--grad-clip": "--optim.grad-clip", "--eval-every": "--log.eval-every",
    "--eval-prompts": "--log.eval-prompts", "--print-every": "--log.print-every", "--trackers": "--log.trackers",
    "--wandb": "--log.wandb",
}


@dataclass
class SFTConfig:
    """Supervised warm start on task solutions, so RL begins from a policy with partial success."""

    out_dir: str | None = None
    """Run directory; the RL run loads out_dir/checkpoints/latest.pt through --init-from. None = a new
    runs/<UTC time>-sft."""
    seed: int = 0
    """Seeds model init and batch order."""
    total_steps: int = 300
    """Optimizer steps."""
    batch_size: int = 64
    """Problems per optimizer step."""
    device: Device = "auto"
    """auto, cpu or cuda."""
    threads: int = 1
    """torch CPU threads."""
    quiet: bool = False
    """Print no progress lines (a divergence is still reported)."""
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    log: SFTLogConfig = field(default_factory=SFTLogConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        check_out_dir_named(self)
        check_numbers(self)
        check_choice("device", self.device, DEVICES)
        for name in ("total_steps", "batch_size", "threads"):
            check_positive(name, getattr(self, name))
