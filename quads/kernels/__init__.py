"""Triton kernels behind the rollout ops. This layer imports only :mod:`quads.tensor`.

Each file holds one kernel family and its launcher; launchers take plain tensors and Python
values (never ops or policy objects), and the host glue that turns an op's arguments into a
launch lives in that op's file under :mod:`quads.ops`.

* :mod:`.quantize_activations` -- fused activation quantization + residual compensation (one
  program per row); :mod:`.quantize_weights` and :mod:`.amax` -- weight quantization (amax pass +
  tile quantizer); :mod:`.nvfp4_blocks` -- the block arithmetic they share, bit-exact with
  ``nvfp4_math``; :mod:`.fake_quantize_nvfp4` -- the trainer's fused ``DQ(Q(w))``;
* :mod:`.w4a4_decode_hopper` -- exact W4A4 (+ residual) decode GEMM for Hopper (few tokens:
  split-K over canonical segments, the weight decoded in registers); deterministic, batch-invariant;
* :mod:`.w4a4_gemm_hopper` -- its prefill twin (many tokens: one walk over K of the decoded fp16
  weight, the same segment order and bits);
* :mod:`.moe_grouped_gemm` -- the grouped twin over packed 3-D experts, driven by top-k routing;
  :mod:`.moe_routing` -- that routing (rows grouped by expert) in one launch for decode sizes;
* :mod:`.hopper_weight_layout` -- the weight layout those GEMMs read: its torch reference, the
  kernel that builds it from the packed parts (weight sync); :mod:`.hopper_weight_decode` -- its
  in-register decode inside the GEMMs;
* :mod:`.blackwell` -- native FP4 through ``torch._scaled_mm`` (written, NOT RUN);
* :mod:`.fp16_operand`, :mod:`.arrival_counters` -- W4A16's fp16 operand; split-K arrival counters;
* :mod:`._interpreter` -- the ``TRITON_INTERPRET=1`` (CPU test) helpers; under the interpreter the
  ``pick_*`` configs are the GPU's on smaller tiles (tests/kernels/test_kernel_configs.py).

See ``docs/kernels.md`` for the design and the H200 measurements.
"""
