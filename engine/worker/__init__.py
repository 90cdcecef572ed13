"""The worker: turns one scheduled step into model inputs, runs the model, samples.

- `model_runner`: one step end to end (inputs, forward, logits, sampling, logprobs).
- `input_batch` / `device_inputs`: block tables, slot mapping and positions for a step.
- `sampler` / `penalties`: vLLM's sampling (greedy, temperature, top-k/p, seeds, penalties).
- `cuda_graphs`: captured decode steps on CUDA.
- `device` / `gpu_memory` / `host_malloc`: where tensors live and how much KV fits.

Invariant: the worker holds no scheduling state; it reads what the scheduler decided.
"""
