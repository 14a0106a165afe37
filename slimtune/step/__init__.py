"""The parts of one training step every engine shares: the loss (loss.py), checkpointed blocks and
their recompute (activations.py), a block in tiles of tokens (seq_tiles.py), where a checkpointed
block's input waits (block_stores.py), the loss through the whole model (forward.py), autocast
(precision.py) and autograd hooks that do not keep an engine alive (hooks.py)."""
