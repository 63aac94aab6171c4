"""Test session set-up: without a GPU, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before ``quads.kernels`` is imported (Triton reads it when the
kernels are decorated), so it is set here, once, for the whole session.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (scripts/test.sh), the workers share the cores instead of each taking all.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# -- replaying the weight quantizer kernel's output for repeated, identical inputs ---------------

import hashlib  # noqa: E402

import pytest  # noqa: E402

_WEIGHT_KERNEL_RESULTS: dict = {}
_MEMO_MAX_NUMEL = 1 << 22  # tiny test models only


def _tensor_key(t):
    if t is None:
        return None
    d = t.detach().cpu().contiguous()
    digest = hashlib.sha256(d.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.device.type, digest)


@pytest.fixture
def memo_weight_kernel(monkeypatch):
    """Under the interpreter, the hopper/humming backends' weight quantizer
    (``quantize_weight_triton``: an amax pass + the tile quantizer, the bulk of every model-level
    test's time there) runs once per distinct input for the whole session; a repeated call with
    the same input bytes, dtype, shape, strides, granularity, given global scale and block scaling gets clones of
    the kernel's own outputs of the first call. The kernel is a deterministic function of exactly
    these, so every test sees the bits the kernel returns (tests/kernels test the kernel itself,
    against the reference, without this). Opt-in per module (``pytest.mark.usefixtures``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # on a GPU the kernel is fast: always run it
    import quads.ops.backends.hopper as hopper  # the humming backend inherits its quantize_weight
    from quads.ops.weight_quant import quantize_weight_triton
    from quads.tensor.nvfp4_math import NVFP4Parts

    def memo(x, granularity=None, global_encode_scale=None, block_scaling="6"):
        if x.numel() > _MEMO_MAX_NUMEL:
            return quantize_weight_triton(x, granularity, global_encode_scale, block_scaling)
        key = (_tensor_key(x), granularity, _tensor_key(global_encode_scale), block_scaling)
        hit = _WEIGHT_KERNEL_RESULTS.get(key)
        if hit is None:
            out = quantize_weight_triton(x, granularity, global_encode_scale, block_scaling)
            with torch.inference_mode(False):
                hit = _WEIGHT_KERNEL_RESULTS[key] = NVFP4Parts(*(t.clone() for t in out))
            return out
        return NVFP4Parts(*(t.clone() for t in hit))

    monkeypatch.setattr(hopper, "quantize_weight_triton", memo)
