"""The Hopper backend's Triton kernels (exact emulation: deterministic, batch invariant).

* :mod:`.w4a4_decode` -- W4A4 (+ residual) decode GEMM (few tokens: split-K over canonical
  segments, the weight decoded in registers);
* :mod:`.w4a4_gemm` -- its prefill twin (many tokens: one walk over K of the decoded fp16 weight,
  the same segment order and bits);
* :mod:`.moe_grouped_gemm` -- the grouped twin over packed 3-D experts, driven by top-k routing;
* :mod:`.weight_layout` -- the weight layout those GEMMs read: its torch reference, the kernel that
  builds it from the packed parts (weight sync); :mod:`.weight_decode` -- its in-register decode;
* :mod:`.fp16_operand`, :mod:`.arrival_counters` -- W4A16's fp16 operand; split-K arrival counters.
"""
