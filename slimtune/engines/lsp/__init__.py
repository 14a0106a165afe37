"""The parts of engine lsp (engine.py registers it; spec lsp-offload.md):
projected_linear.py (a block linear trained in a d x d subspace), schedule.py (the layer-wise update
schedule as data, derived from measured times), updates.py (the updates in flight: G_c down, host
AdamW, Z up), learning.py (fitting and checking the projectors), sizing.py (the default d, from the
shapes), speed.py (its modelled step time). The projector math itself is optim/projectors.py."""
