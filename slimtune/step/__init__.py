"""The parts of one training step every engine shares: the loss (loss.py), checkpointed blocks and
their recompute (activations.py), and where a checkpointed block's input waits (block_stores.py)."""
