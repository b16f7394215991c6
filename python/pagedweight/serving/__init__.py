"""The SGLang side of PagedWeight: the MoE and dense-linear methods, layer sources (checkpoint, dummy),
the scheduler step, startup checks and metrics. With patches/, the only code that imports SGLang."""
