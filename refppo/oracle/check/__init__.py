"""One check of a dump under one setting: recompute every quantity through the pipeline, compare,
find the first divergence and explain it (single convention changes, known bugs, the gradient)."""
