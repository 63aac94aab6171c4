"""Integrations with RL frameworks. ``quads.integrations.trl``: TRL's GRPOTrainer (extra ``trl``);
``quads.integrations.transformers``: ``save_pretrained`` / ``from_pretrained`` of quads models
(``quant_method="quads"``, loaded when transformers' quantizer registry is).

Import the submodule explicitly (``from quads.integrations.trl import QuadsGRPOTrainer``); it
imports TRL lazily so that ``import quads`` never needs it.
"""
