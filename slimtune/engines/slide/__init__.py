"""Engine slide (SlideFormer, specs slideformer.md): the engine (engine.py), the exact
cross-entropy against a head streamed in vocabulary tiles (streamed_ce.py), and the chunk working
set's kept host gradients (host_gradients.py)."""
