"""vapo-megatron: VAPO on Megatron-core with vLLM rollouts."""
