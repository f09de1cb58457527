"""The vLLM worker extension moe-rl installs in the engine (`LLM(worker_extension_cls=...)`): its methods run inside
each vLLM worker process, called from the trainer through `llm.collective_rpc(name, args=...)`.

- `moe_rl_capture_on` / `moe_rl_capture_take`: a capture function on every MoE layer's router
  (`router.set_capture_fn`), so that the expert ids of every forward the engine runs are kept, per layer, in the
  order the tokens were computed. vLLM's own `routed_experts` output needs its Model Runner V2, which needs Triton,
  which has no CPU build; the router's capture hook works on every device.
- `moe_rl_load`: load the trainer's weights (name -> tensor) with the worker's `reload_weights`, then rebuild each
  fused-MoE kernel's prepacked expert weights (`process_weights_after_loading`): vLLM's CPU kernel otherwise keeps
  the weights it packed at start-up (vLLM 0.32; tests/rl/test_vllm_engine.py fails if that comes back).

Nothing here imports vllm at module level: the module is imported by name inside the worker, where vllm is loaded.
"""

from __future__ import annotations

import torch


def _moe_runners(model):
    """(decoder layer id, module) of every vLLM MoE layer with a router that takes a capture function."""
    runners = []
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is not None and hasattr(router, "set_capture_fn") and hasattr(module, "layer_id"):
            runners.append((int(module.layer_id), module))
    return sorted(runners, key=lambda pair: pair[0])


def _prepacked_kernels(model):
    """(layer module, fused-experts object) of every MoE layer whose kernel prepacks its weights."""
    out = []
    for module in model.modules():
        if "w13_weight" not in dict(module.named_parameters(recurse=False)):
            continue  # the layer that owns the expert weights (vLLM 0.32: RoutedExperts), not its runner
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None), "fused_experts",
                                                                    None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            out.append((module, experts))
    return out


class MoERLWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def _moe_rl_model(self):
        return self.model_runner.get_model()

    def moe_rl_capture_on(self) -> list[int]:
        """Install the capture on every MoE router, and note each step's requests in the order their tokens sit in
        the forward's batch; returns the decoder layer ids captured, in depth order."""
        if getattr(self, "_moe_rl_captured", None) is not None:
            return sorted(self._moe_rl_captured)
        self._moe_rl_captured, self._moe_rl_steps = {}, []
        for layer_id, runner in _moe_runners(self._moe_rl_model()):
            self._moe_rl_captured[layer_id] = []

            def keep(topk_ids, store=self._moe_rl_captured[layer_id]):
                store.append(topk_ids.detach().to("cpu", torch.int16, copy=True))

            runner.router.set_capture_fn(keep)
        execute = self.execute_model

        def execute_and_note(scheduler_output, *args, **kwargs):
            out = execute(scheduler_output, *args, **kwargs)
            counts = scheduler_output.num_scheduled_tokens
            if scheduler_output.total_num_scheduled_tokens > 0:
                self._moe_rl_steps.append([(rid, counts[rid]) for rid in self.model_runner.input_batch.req_ids
                                           if rid in counts])
            return out

        self.execute_model = execute_and_note
        return sorted(self._moe_rl_captured)

    def moe_rl_capture_take(self) -> dict[str, dict[int, torch.Tensor]]:
        """Everything computed since the last take, split by request: request id -> decoder layer id -> int16
        [tokens in the order computed, K]; emptied. Refuses a capture whose rows do not add up to the steps'."""
        steps, self._moe_rl_steps = self._moe_rl_steps, []
        per_layer = {}
        for layer_id, chunks in self._moe_rl_captured.items():
            per_layer[layer_id] = torch.cat(chunks) if chunks else torch.zeros(0, 1, dtype=torch.int16)
            chunks.clear()
        total = sum(n for step in steps for _, n in step)
        for layer_id, rows in per_layer.items():
            if rows.shape[0] != total:
                raise RuntimeError(f"moe-rl routing capture: layer {layer_id} captured {rows.shape[0]} token rows but "
                                   f"the engine scheduled {total} tokens (a padded or repeated forward?)")
        out: dict[str, dict[int, list]] = {}
        offset = 0
        for step in steps:
            for rid, n in step:
                parts = out.setdefault(rid, {layer_id: [] for layer_id in per_layer})
                for layer_id, rows in per_layer.items():
                    parts[layer_id].append(rows[offset:offset + n])
                offset += n
        return {rid: {layer_id: torch.cat(chunks) for layer_id, chunks in parts.items()} for rid, parts in out.items()}

    def moe_rl_load(self, state: dict[str, torch.Tensor]) -> int:
        """Reload the model from a Hugging Face state dict; returns the number of MoE kernels repacked."""
        self.reload_weights(weights_iterator=iter(state.items()))
        kernels = _prepacked_kernels(self._moe_rl_model())
        for module, experts in kernels:
            experts.process_weights_after_loading(module)
        return len(kernels)
