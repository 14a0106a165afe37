"""Several processes: Dist, the ranks and their sums (ranks.py), dist.strategy=fsdp (sharding.py),
and gradients summed across ranks while backward runs (grad_buckets.py)."""
