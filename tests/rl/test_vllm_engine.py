"""vLLM as the rollout engine (moe_rl/rl/vllm_engine.py), on CPU: skipped where vllm is not installed.

- fp32 engine (precision 'trainer'): its log-probs equal the trainer's forward of the same tokens to fp32 rounding
  and its routing (captured on every router) equals the trainer's own choice at every position: 0 set changes.
- bf16 engine: a real engine-trainer mismatch, non-zero.
- weight sync: after an update the engine's log-probs equal the trainer's new ones and differ from the old ones
  (fails if vLLM's CPU MoE kernel keeps its stale prepacked weights, the repack bug).
- the native model, served as its exact Mixtral export (moe_rl/model/hf/native.py): the same two equalities, before
  and after a sync that goes through the same mapping.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from moe_rl.model.config import ModelConfig  # noqa: E402
from moe_rl.model.hf.load import tiny_hf_model  # noqa: E402
from moe_rl.rl.engines import build_engine  # noqa: E402
from moe_rl.rl.rollout import SamplingConfig, encode_prompts  # noqa: E402
from moe_rl.routing.churn import churn_stats  # noqa: E402
from moe_rl.routing.replay import record_routing  # noqa: E402
from moe_rl.tasks import CharTokenizer  # noqa: E402

PROMPTS = ["1+2=", "12+345=", "7=", "40+5+61=", "3+3=", "99+1="]


def _model(seed=0, family="qwen3_moe", n_layers=3):
    """A tiny model of `family` (head_dim 32: vLLM's CPU attention serves 32, 64, 128, ...), fp32."""
    torch.manual_seed(seed)
    cfg = ModelConfig(backend="hf", hf_config=family, vocab_size=99, d_model=64, n_layers=n_layers, n_heads=2,
                      n_kv_heads=1, n_experts=8, top_k=2, d_expert=32, d_dense=64, max_seq_len=64, init_std=0.1)
    return tiny_hf_model(family, cfg).eval()


def _trainer_view(model, gen, temperature=1.0):
    """The trainer's log-probs of the sampled tokens and its own routing of the same input (one full forward)."""
    with torch.no_grad(), record_routing(model) as recorder:
        logits = model(gen.input_ids_BS, gen.input_valid_BS).logits_BSV
    logp = torch.log_softmax(logits.float() / temperature, -1)[:, gen.prompt_len - 1:]
    logp_BN = logp.gather(-1, gen.response_BN[:, :, None]).squeeze(-1) * gen.response_mask_BN
    return logp_BN, recorder.trace()


def _fed_BS(gen):
    """Input positions the engine ran: every real token but each row's last (which vLLM never feeds back; the
    native sampler feeds a finished row's EOS while longer rows go on, but its logits score no token)."""
    valid_BS = gen.valid_BS.clone()
    last_B = valid_BS.shape[1] - 1 - valid_BS.flip(1).int().argmax(1)
    valid_BS[torch.arange(valid_BS.shape[0]), last_B] = False
    return valid_BS[:, :-1]


def _sample(engine, model, seed=1, n=12):
    tok = CharTokenizer()
    ids, valid = encode_prompts(PROMPTS, tok, "cpu")
    cfg = SamplingConfig(max_new_tokens=n)
    draw = lambda eos: engine.generate(model, ids, valid, cfg, eos_id=eos, pad_id=tok.pad_id,
                                       generator=torch.Generator().manual_seed(seed), record=True)
    # A random model rarely samples the real EOS: a token the first row samples early stands in for it (the same
    # seeds draw the same tokens up to it), so completions end at different lengths.
    first = draw(-1)
    return draw(int(first.response_BN[0, 2]))


@pytest.fixture(scope="module")
def fp32():
    model = _model()
    engine = build_engine("vllm", model, SamplingConfig(precision="trainer"))
    yield model, engine
    engine.close()


def test_fp32_engine_equals_the_trainer(fp32):
    model, engine = fp32
    gen = _sample(engine, model)
    logp_BN, trainer_routing = _trainer_view(model, gen)
    mask = gen.response_mask_BN
    assert mask.sum() > len(PROMPTS) and (mask.sum(1) < mask.shape[1]).any()  # several lengths, some EOS
    assert (gen.logprobs_BN - logp_BN)[mask].abs().max() < 1e-5
    assert torch.equal(gen.routed_BS, _fed_BS(gen))  # the engine names the positions it ran
    stats = churn_stats(gen.routing, trainer_routing, _fed_BS(gen))
    assert stats.n_tokens == int(gen.valid_BS.sum()) - len(PROMPTS)
    assert (stats.set_change, stats.token_any, stats.churn) == (0.0, 0.0, 0.0)


def test_weight_sync_reaches_the_engine(fp32):
    model, engine = fp32
    before = _sample(engine, model, seed=2)
    with torch.no_grad():  # an "optimizer step": every weight moves
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    old_logp, _ = _trainer_view(model, before)  # the new model's log-probs of the old tokens
    engine.sync(model, version=1)
    assert engine.repacked == 3  # every MoE layer's prepacked CPU kernel rebuilt
    after = _sample(engine, model, seed=2)
    logp_BN, routing = _trainer_view(model, after)
    mask = after.response_mask_BN
    assert (after.logprobs_BN - logp_BN)[mask].abs().max() < 1e-5
    assert churn_stats(after.routing, routing, _fed_BS(after)).set_change == 0.0
    assert (before.logprobs_BN - old_logp)[before.response_mask_BN].abs().max() > 1e-3  # the old ones are stale


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_other_families_equal_the_trainer_before_and_after_a_sync(family):
    """Qwen2-MoE (a gated shared expert beside the routed ones) and Mixtral (whose MoE block transformers 5 renames
    in memory: the sync sends checkpoint names) are served exactly too."""
    model = _model(family=family, n_layers=2)
    engine = build_engine("vllm", model, SamplingConfig(precision="trainer"))
    try:
        for version in (0, 1):
            if version:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.05)
                engine.sync(model, version)
            gen = _sample(engine, model, seed=version)
            logp_BN, routing = _trainer_view(model, gen)
            assert (gen.logprobs_BN - logp_BN)[gen.response_mask_BN].abs().max() < 1e-5
            assert churn_stats(gen.routing, routing, _fed_BS(gen)).set_change == 0.0
    finally:
        engine.close()


NATIVE = {"vocab_size": 99, "d_model": 64, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1, "n_experts": 8, "top_k": 2,
          "d_expert": 32, "max_seq_len": 64, "init_std": 0.1}


@pytest.mark.parametrize("fields", [{}, {"n_heads": 4, "n_kv_heads": 2, "d_model": 128, "tie_embeddings": True,
                                         "rope_theta": 500.0, "norm_eps": 1e-5}])
def test_the_native_model_is_served_exactly_before_and_after_a_sync(fields):
    """The native MoETransformer (this machine's kernels, as the trainer builds it) through its Mixtral export:
    fp32 log-probs within 1e-5 of the trainer's and 0 set changes, at start-up and after every weight moved."""
    from moe_rl import kernels
    from moe_rl.model import MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(**{**NATIVE, **fields})
    model = MoETransformer(cfg, kernels=kernels.machine()).eval()
    engine = build_engine("vllm", model, SamplingConfig(precision="trainer"))
    try:
        for version in (0, 1):
            if version:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.05)
                engine.sync(model, version)
                assert engine.repacked == cfg.n_layers
            gen = _sample(engine, model, seed=version)
            logp_BN, routing = _trainer_view(model, gen)
            mask = gen.response_mask_BN
            assert mask.sum() > len(PROMPTS)
            diff = (gen.logprobs_BN - logp_BN)[mask].abs().max()
            stats = churn_stats(gen.routing, routing, _fed_BS(gen))
            print(f"native via vLLM, version {version}: max |logp diff| {diff:.2e} over {int(mask.sum())} tokens; "
                  f"set_change {stats.set_change} over {stats.n_tokens} routed tokens x {cfg.n_layers} layers")
            assert diff < 1e-5
            assert stats.n_tokens > 0 and stats.set_change == 0.0
    finally:
        engine.close()


def test_bf16_engine_mismatch_is_real():
    model = _model(seed=3)
    engine = build_engine("vllm", model, SamplingConfig(precision="bf16"))
    try:
        gen = _sample(engine, model, n=16)
    finally:
        engine.close()
    logp_BN, trainer_routing = _trainer_view(model, gen)
    mask = gen.response_mask_BN
    diff = (gen.logprobs_BN - logp_BN)[mask].abs()
    assert diff.max() > 1e-4  # bf16 rounding, not fp32's
    stats = churn_stats(gen.routing, trainer_routing, _fed_BS(gen))
    print(f"bf16 engine vs fp32 trainer: |logp diff| mean {diff.mean():.2e} max {diff.max():.2e}; "
          f"set_change {stats.set_change:.4f} token_any {stats.token_any:.4f} over {stats.n_tokens} tokens")


SIZES = ["--model.d-model", "64", "--model.n-heads", "2", "--model.n-kv-heads", "1", "--model.n-layers", "2",
         "--model.n-experts", "8", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
QWEN3_MOE = ["--model.backend", "hf", "--model.hf-config", "qwen3_moe", *SIZES]


def _train(tmp_path, precision: str, *extra: str, model=QWEN3_MOE) -> list[dict]:
    """Two rollout steps through the CLI: tiny Qwen3-MoE (or `model`), vLLM engine, R3, the rollout mismatch probe
    on."""
    from moe_rl.cli import main

    out = tmp_path / precision
    args = ["train", *model, "--rollout.engine", "vllm",
            "--routing-mode", "R3", "--rollout.sampling.precision", precision, "--total-steps", "2",
            "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--probes.enabled", "rollout",
            "--out-dir", str(out), *extra]
    assert main(args) == 0
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_r3_with_the_fp32_engine_has_no_mismatch(tmp_path):
    # Over every position the engine ran (prompt tokens included), not only those that score the response.
    lines = [m for m in _train(tmp_path, "trainer", "--probes.tokens", "all") if "routing/rollout/set_change" in m]
    assert {m["step"] for m in lines} == {0, 1}  # both rollout steps
    assert all(m["routing/rollout/set_change"] == 0.0 for m in lines)
    assert all(m["rollout/kl"] < 1e-10 for m in lines)  # k3 of the engine vs the trainer's old pass


def test_cli_r3_native_model_with_the_fp32_engine_has_no_mismatch(tmp_path):
    """`--model.backend native --rollout.engine vllm`: the engine serves the native model's Mixtral export and is
    synced through the same map after step 0's updates; both rollouts match the trainer's old pass exactly."""
    lines = [m for m in _train(tmp_path, "trainer", "--probes.tokens", "all", "--minibatches", "2",
                               model=["--model.backend", "native", *SIZES]) if "routing/rollout/set_change" in m]
    assert {m["step"] for m in lines} == {0, 1}
    assert all(m["routing/rollout/set_change"] == 0.0 for m in lines)
    assert all(m["rollout/kl"] < 1e-10 for m in lines)


def test_cli_r3_with_the_bf16_engine_shows_the_mismatch(tmp_path):
    lines = [m for m in _train(tmp_path, "bf16") if "rollout/log_ratio_abs_mean" in m]
    assert min(m["rollout/log_ratio_abs_mean"] for m in lines) > 1e-5
    assert max(m["rollout/kl"] for m in lines) > 1e-10


def test_cli_resume_starts_the_engine_from_the_checkpoint(tmp_path):
    """A resumed run builds its engine from the restored weights: the step after the resume has no mismatch."""
    _train(tmp_path, "trainer", "--checkpoint-every", "1")
    lines = _train(tmp_path, "trainer", "--checkpoint-every", "1", "--total-steps", "3", "--resume")
    last = [m for m in lines if m["step"] == 2 and "routing/rollout/set_change" in m]
    assert last and last[0]["routing/rollout/set_change"] == 0.0 and last[0]["rollout/kl"] < 1e-10


@pytest.mark.slow
def test_cli_a_worker_that_dies_mid_run_fails_by_name_and_the_printed_command_resumes(tmp_path, monkeypatch, capsys):
    """The vLLM worker raises in the weight sync after step 0 (as a worker that lost its process does): `moe-rl
    train` ends with one line naming the engine, the step and the resume command (status 1, run failed); that
    command, with a healthy worker, continues from step 1's checkpoint and its rollouts match the trainer exactly."""
    import json
    import shlex

    from moe_rl.cli import main
    from moe_rl.rl.vllm_worker import MoERLWorkerExtension

    def dies(self, state):
        raise RuntimeError("worker process lost (test)")

    run = tmp_path / "run"
    argv = ["train", *QWEN3_MOE, "--rollout.engine", "vllm", "--routing-mode", "R3", "--total-steps", "3",
            "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--probes.enabled", "rollout",
            "--checkpoint-every", "1", "--out-dir", str(run), "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(MoERLWorkerExtension, "moe_rl_load", dies)
        assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moe-rl train: error: rollout engine vllm failed at rollout step 1 on rank 0 (RuntimeError: "
                          "worker process lost (test)); the run continues from its last checkpoint with: moe-rl train")
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"

    resume = shlex.split(err.split("checkpoint with: ", 1)[1])
    assert main([*resume[1:], "--quiet"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({m["step"] for m in lines}) == [0, 1, 2]
    resumed = [m for m in lines if m["step"] >= 1 and "rollout/kl" in m]
    assert {m["step"] for m in resumed} == {1, 2} and all(m["rollout/kl"] < 1e-10 for m in resumed)
    assert all(m["time/sync"] > 0 for m in resumed if m["step"] == 2)  # step 2's engine loaded step 1's updates
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"


RANK_REPORT = '''
"""torchrun runs this: moe-rl train, with each rank noting what its engine sampled and, at the end, a digest of its
weights (rank<r>.json in the run directory)."""
import hashlib, json, sys
from pathlib import Path

from moe_rl.cli import main
from moe_rl.rl import distributed
from moe_rl.rl.trainer import Trainer

rollouts, rollout, close = [], Trainer.rollout, Trainer.close


def noted_rollout(self):
    batch, metrics = rollout(self)
    rollouts.append({"step": self.step, "engine": type(self.engine).__name__, "engine_version": self.engine.version,
                     "updates": self.updates, "rows": batch.size, "prompts": sorted(set(batch.prompts))})
    return batch, metrics


def noted_close(self):
    digest = hashlib.sha256()
    for name, tensor in sorted(self.model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    Path(self.cfg.out_dir, f"rank{distributed.rank()}.json").write_text(
        json.dumps({"rollouts": rollouts, "weights": digest.hexdigest(), "updates": self.updates}))
    close(self)


Trainer.rollout, Trainer.close = noted_rollout, noted_close
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_torchrun_two_ranks_each_drive_their_own_engine(tmp_path):
    """`torchrun --nproc-per-node 2 -m moe_rl.cli train --rollout.engine vllm` on CPU (gloo), 2 rollout steps: each
    rank's own vLLM engine samples its own prompts, is synced to the weights after step 0's updates, and
    matches that rank's trainer exactly (R3, fp32: rollout k3 and set changes 0, reduced over the ranks); both ranks
    end with bit-identical weights."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script, run = tmp_path / "ranks.py", tmp_path / "run"
    script.write_text(RANK_REPORT)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
            "train", *QWEN3_MOE, "--rollout.engine", "vllm", "--routing-mode", "R3", "--total-steps", "2",
            "--rollout.prompts-per-step", "8", "--rollout.group-size", "4", "--minibatches", "2",
            "--probes.enabled", "rollout", "--probes.tokens", "all", "--out-dir", str(run), "--quiet"]
    done = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert [n["step"] for n in report["rollouts"]] == [0, 1]
        assert all(n["engine"] == "VLLMEngine" and n["rows"] == 4 * 4 for n in report["rollouts"])
        assert [n["engine_version"] for n in report["rollouts"]] == [0, 2]  # synced after step 0's 2 updates
        assert report["updates"] == 4
    for step in (0, 1):
        prompts = [set(report["rollouts"][step]["prompts"]) for report in ranks]
        assert prompts[0] and prompts[1] and prompts[0] != prompts[1]  # each rank's own share of the step's prompts
    assert ranks[0]["weights"] == ranks[1]["weights"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in lines} == {0, 1}
    assert all(m["routing/rollout/set_change"] == 0.0 and m["rollout/kl"] < 1e-10 for m in lines)
    assert "Traceback" not in done.stderr  # the engines shut down before torchrun's process group is torn down
