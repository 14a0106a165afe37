"""RoundPipe (roundpipe.md): stages of a sequential model dispatched round robin to stateless workers.

The schedule, as data:
  stages.py       layer costs, stages, a partition, jobs on workers from the global cursor
  partitioner.py  the partition from measured (or modelled) per-layer costs; brute force for tests
The runtime (engine roundpipe, engine.py):
  optimizer.py    roundpipe.optimizer's variants as objects: sync (exact) and async (one step stale)
  step_weights.py async: which weights each step computes at, and what a step begun early waits for
  worker.py       a stateless worker: its thread, streams, module replica, weight prefetch
  replica.py      a module tree sharing the original's tensors, rebound per worker
  jobs.py         forward, fused-tail and backward jobs over the micro-batches
  mailbox.py      hand-offs between workers; a failure wakes every waiter
  timing.py       per-layer times measured in the jobs, for the partitioner's EMA
  row_split.py    a batch cut by rows into micro-batches
  settings.py     the roundpipe.* settings, what the engine refuses, the workers' devices
The simulator (`slimtune simulate`):
  simulate.py     the same jobs as a discrete-event simulation, the comparison and the CLI
  schedule.py     the event engine and its result
  baselines.py    GPipe, 1F1B and interleaved 1F1B with stages bound to workers, with offload
  cost_model.py   per-layer costs: modelled from a preset and a card, measured from a file, the spec's
  timeline.py     the schedules as a timeline picture (PNG)
"""
