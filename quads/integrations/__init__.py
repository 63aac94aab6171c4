"""Integrations with RL frameworks. ``quads.integrations.trl``: TRL's GRPOTrainer (extra ``trl``).

Import the submodule explicitly (``from quads.integrations.trl import QuadsGRPOTrainer``); it
imports TRL lazily so that ``import quads`` never needs it.
"""
