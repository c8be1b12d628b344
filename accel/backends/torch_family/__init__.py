"""The torch backends, eager and compile (compile.py: eager's step with the forward and loss
compiled), in parts of one job each: the optimizer step they share with xla (core.py), and the
layout of the model over the ranks: what every layout gives the step (layout.py), the whole
model on each rank (whole.py: one process, or DDP's replicas), the model split over the mesh
(split.py) with its pipeline (stages.py) and its split classifier (head.py), and the step's
reductions over the mesh (reductions.py)."""
