"""Native kernels for the host optimizer: C files compiled at first use (build.py) and called through
ctypes, each bit-identical to the torch path it replaces, which remains wherever no compiler is found
(adamw.py: the one-pass AdamW over a split or whole fp32 master)."""
