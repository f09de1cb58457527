"""The RL step: the run config, what every entry point builds (model, tokenizer, optimizer), the sampler, the
policy's forward, advantages, rollout correction, signals, probes, held-out accuracy and the Trainer that runs one
rollout step after another (docs/design.md section 2)."""
