"""Optimisation shared by the engines: the rules every engine follows (rules.py) and AdamW over
flat host tensors for engines that keep their trainable state off the device (host_adam.py)."""
