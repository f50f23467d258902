"""The run's settings: every section of a recipe as a keyword-only dataclass, the checks that
refuse impossible combinations, and the YAML recipe loader. Nothing here imports Megatron, so
reading a recipe (slurm/check_inputs.py, tools/plan.py, tools/ablate.py) stays cheap.
"""
