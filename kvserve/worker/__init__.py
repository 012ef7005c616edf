"""The worker: runs a scheduled step on the device. `runner.ModelRunner` builds the flat batch and
the attention metadata, runs the model (CUDA graphs for decode steps) and the batched sampler
(`sampler`). Below the engine; above the scheduler, whose output it executes, and the models."""
