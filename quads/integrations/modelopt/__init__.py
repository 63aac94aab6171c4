"""Deployment export: a QUADS-trained model as a ModelOpt NVFP4 checkpoint.

* :mod:`quads.integrations.modelopt.export`: :func:`export_modelopt` (``quads export``);
* :mod:`quads.integrations.modelopt.calibrate`: static activation amax for the W4A4 format.

The tensor layout itself (and reading a checkpoint back into ``quads.NVFP4Tensor``) lives in
:mod:`quads.tensor.modelopt_format`. Needs transformers (the ``hf`` extra), not ModelOpt.
"""

from quads.integrations.modelopt.export import FORMATS, ExportReport, export_modelopt

__all__ = ["FORMATS", "ExportReport", "export_modelopt"]
