"""The humming backend's kernels around humming's GEMMs: :mod:`.layout` (humming's weight layout
restated in torch, a pure permutation and its inverse; the padded shapes), :mod:`.operands` (the
operand sum and the epilogue Triton kernels)."""
