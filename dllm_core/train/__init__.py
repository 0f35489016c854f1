"""Training of the task-suite demo models: ``dllm train-mdm`` (LLaDA-architecture masked diffusion)
and ``dllm train-ar`` (Qwen3-architecture causal LM), sharing data, loop and checkpointing."""
