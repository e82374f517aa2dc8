"""spotvisor's trainer library: what every rank of a training job uses.

Importing this package does not import torch; the submodules that need it do.
"""
