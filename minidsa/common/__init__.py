"""The bottom layer every other package shares: plain data and the device structures both the control plane and the
worker name. Nothing here imports a package above `kernels`.

- `request`: `SamplingParams`, `Request`, `RequestOutput`, `InvalidRequest` (plain structs every layer passes on);
- `tokenizer`: the `Tokenizer` (chat formats render prompts with it below the engine);
- `plan`: `StepKind`, `StepPlan`, `StepResult`: what crosses from the control plane to the worker and back;
- `batch`: `ForwardBatch`, what one model call sees (the model and the attention backend read it);
- `kv_cache`: the device caches and their layouts (`KVCache`, `CacheLayouts`) and the page -> slot map;
- `sampling`: the `Sampler` (the worker and the speculator sample and accept with it);
- `presets`: the presets' raw configs (plain dicts), resolved by config before any model exists;
- `tensor_parallel`: a rank's `TensorParallel` (its place and collectives), which the layers are built for;
- `version`: the package version (the compile cache keys on it).
"""
