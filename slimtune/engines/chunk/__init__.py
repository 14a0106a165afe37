"""The parts of engine chunk (engine.py registers it; spec chunkft.md): sliced.py
(slice-aware autograd ops and the module wrappers that install them in place, so each backward makes
weight gradients only for the active slice of every parameter, in side buffers, never a dense
.grad), partition.py (the byte-stream partition of the trainable parameters into chunks)."""
