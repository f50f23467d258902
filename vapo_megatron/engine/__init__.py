"""The engines below the step: each model's Megatron engine (DDP, optimizer, schedule, its
process groups), the training-state offload around rollouts and the host arena it stages in."""
