"""Checkpoints: the model-checkpoint format (``model.py``: weights plus metadata, what
``tools/convert.py`` reads and writes) and training checkpoints, what a run needs to continue
where it stopped, written atomically (``directory.py``, ``save.py``, ``load.py``; ``state.py``
builds the sharded state both write and read; ``optimizer_state.py`` and ``rng.py`` the rest).

On disk, under the run's checkpoint root::

    latest                          the step of the newest complete checkpoint ("12\\n")
    step_00000012/                  one complete checkpoint
        COMPLETE                    written last, before the rename; without it nothing loads
        meta.json                   format, step, world size, each model's layout and optimizer
                                    format
        extra.pt                    the trainer's state (rank 0's; identical on every rank)
        rng/rank_00000.pt           per rank: python, numpy, torch CPU (and CUDA), Megatron's tracker
        policy/weights/             megatron dist_checkpointing (torch_dist): the model's
                                    ``sharded_state_dict``; with weights metadata also
                                    ``vapo_checkpoint.json``, and `tools/convert.py mcore-to-hf`
                                    exports it
        policy/optimizer/           dist_checkpointing: the optimizer's ``sharded_state_dict``
        policy/scheduler.pt         the learning-rate schedule's position (rank 0's)
        critic/...
    step_00000014.tmp-3f9a2c1b/     a save in progress, or killed: never loaded, removed by the
                                    next successful save

Each tensor is written once: replicas (data- and context-parallel copies of a weight, the plain
optimizer's state) are split between the model's DP x CP ranks by megatron's fully parallel
strategy, so a checkpoint has the same bytes at any DP size. Loading reshards: another DP or
CP size always; another TP/PP with the plain optimizer (its state is per parameter) or with a
distributed optimizer saved ``fully_reshardable`` (``TrainableState.fully_reshardable``; the
save gathers each DP group's state, so it costs host memory); the distributed optimizer's
default ``dp_reshardable`` format stores its own buckets and loads at another DP/CP only. At
the same layout a resume is bit for bit.
"""
