"""Deployment export: a QUADS-trained model as a ModelOpt NVFP4 checkpoint.

* :mod:`quads.integrations.modelopt.export`: :func:`export_modelopt` (``quads export``);
* :mod:`quads.integrations.modelopt.calibrate`: static activation amax for the W4A4 format;
* :mod:`quads.integrations.modelopt.load`: :func:`load_exported`, an exported directory back
  into a transformers model (the trainer's forward weights, or the quads rollout).

The tensor layout itself (and reading a checkpoint back into ``quads.NVFP4Tensor``) lives in
:mod:`quads.tensor.modelopt_format`. Needs transformers (the ``hf`` extra), not ModelOpt.
"""

from quads.integrations.modelopt.export import DTYPES, FORMATS, ExportReport, export_modelopt
from quads.integrations.modelopt.load import load_exported

__all__ = ["DTYPES", "FORMATS", "ExportReport", "export_modelopt", "load_exported"]
