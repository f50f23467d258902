"""Starting the ranks: the local launcher (vapo-train without torchrun or srun) and the
ranks' malloc settings."""
