"""RoundPipe (roundpipe.md): stages of a sequential model dispatched round robin to stateless workers.

stages.py      the schedule as data: layer costs, stages, a partition, jobs on workers
partitioner.py the partition from measured (or modelled) per-layer costs
simulate.py    the same jobs as a discrete-event simulation, beside GPipe and 1F1B
"""
