"""The CPU task and its models: the synthetic and long-trace tasks, the tiny Qwen2 policy,
reward model and their builders, and the shipped warmed-up assets (demo/, long/). Nothing
here is downloaded: each is built from a seed on first use or shipped in this folder."""
