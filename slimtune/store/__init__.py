"""What slimtune writes and reads back as files: the one checkpoint format (checkpoint.py) and the
manifest that marks a result folder as slimtune's own (results.py)."""
