"""Blackwell native FP4 path (NOT RUN on this project's hardware): layout helper on CPU; the GEMM
itself only on an sm_100+ GPU."""


import pytest
import torch


from quads.kernels.blackwell import fp4_unscaled_mm, is_blackwell, to_blocked
from quads.ops.linear_op import unscaled_values
from quads.tensor.nvfp4_math import nvfp4_quantize


def test_to_blocked_layout():
    rows, cols = 130, 6
    s = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    out = to_blocked(s)
    assert out.numel() == 256 * 8  # padded to 128 x 4 tiles
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 3), (128, 5), (129, 4)]:
        tile = (r // 128) * 2 + c // 4  # tiles in row-major order of (row block, col block)
        rr, cc = r % 128, c % 4
        assert out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] == s[r, c]


@pytest.mark.skipif(not (torch.cuda.is_available() and is_blackwell(torch.device("cuda"))),
                    reason="needs a Blackwell (sm_100+) GPU")
def test_fp4_unscaled_mm_matches_emulation():
    g = torch.Generator().manual_seed(0)
    a = nvfp4_quantize(torch.randn(256, 512, generator=g).cuda(), "row")
    w = nvfp4_quantize(torch.randn(384, 512, generator=g).cuda())
    got = fp4_unscaled_mm(a, w)
    ref = unscaled_values(a) @ unscaled_values(w).T
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-3)
