"""Engine slide (SlideFormer, spec slide-window.md): the engine (engine.py: the window of blocks,
uploads, recompute, gradients down), its working set (working_set.py: AllTensors, or OneChunk for
slide.working_set=chunk, with host_gradients.py: which host gradients a chunk keeps), its settings
and plans (settings.py), its modelled step time (speed.py), and the exact cross-entropy against a
head streamed in vocabulary tiles (streamed_ce.py)."""
