"""The planner (`slimtune plan`): every engine's plans estimated on fake tensors (estimate.py,
estimate_cache.py, worker.py), judged against a card (planner.py), ranks (rank_plan.py), a plan's
longest sequence (longest_seq.py) and its sequence tile (tile_choice.py), the picture (picture.py,
`--png`) and `slimtune probe` (probe.py)."""
