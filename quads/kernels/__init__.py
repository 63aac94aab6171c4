"""Triton kernels behind the rollout ops. This layer imports only :mod:`quads.tensor`.

Each file holds one kernel family and its launcher; launchers take plain tensors and Python
values (never ops or policy objects), and the host glue that turns an op's arguments into a
launch lives with its backend under :mod:`quads.ops.backends`. Kernels one backend alone runs
are in that backend's package: :mod:`.hopper` (the exact decode, prefill and grouped W4A4 GEMMs,
the weight layout they read), :mod:`.humming` (the kernels around humming's GEMMs). Shared here:

* :mod:`.quantize_activations` -- fused activation quantization + residual compensation (one
  program per row); :mod:`.quantize_weights` and :mod:`.amax` -- weight quantization (amax pass +
  tile quantizer); :mod:`.nvfp4_blocks` -- the block arithmetic they share, bit-exact with
  ``nvfp4_math``; :mod:`.fake_quantize_nvfp4` -- the trainer's fused ``DQ(Q(w))``;
* :mod:`.moe_routing` -- top-k routing (rows grouped by expert) in one launch for decode sizes;
* :mod:`.blackwell` -- native FP4 through ``torch._scaled_mm`` (written, NOT RUN);
* :mod:`._interpreter` -- the ``TRITON_INTERPRET=1`` (CPU test) helpers; under the interpreter the
  ``pick_*`` configs are the GPU's on smaller tiles (tests/kernels/test_kernel_configs.py).

See ``docs/kernels.md`` for the design and the H200 measurements.
"""
