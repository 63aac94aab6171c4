"""Trainer group mode on the kernel backends: a sibling group's scale as amax bits
(``HopperBackend.group_scale``: one int32 buffer, one amax pass per member into it) and each
member's fused pass deriving ``S_enc`` from them, bit for bit the torch path
(``shared_global_encode_scale``, then the recipe with that scale).

Runs under TRITON_INTERPRET=1 on CPU or natively on a GPU.
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

import quads  # noqa: E402
from quads.ops.backend_registry import get_backend  # noqa: E402
from quads.ops.weight_quant import (GroupAmaxBits, fake_quantize_weight_reference,  # noqa: E402
                                    fake_quantize_weight_triton)
from quads.policies.modules import TrainerModule  # noqa: E402
from quads.tensor.nvfp4_math import shared_global_encode_scale  # noqa: E402

from tests.kernels.test_kernel_fake_quantize import assert_same_bits  # noqa: E402
from tests.kernels.test_kernel_quantize import DEV  # noqa: E402
from tests.tiny_models import build  # noqa: E402

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))


def _members(kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Three siblings (row counts off the amax tile, K over several column chunks); ``kind``
    plants the group's corner in the last one."""
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(24, 64, generator=g), torch.randn(13, 64, generator=g) * 5.0, torch.randn(40, 64, generator=g)]
    if kind == "inf":
        ws[2][7, 9] = float("-inf")  # amax inf: S_enc 0 -> 1 (the recipe's guard)
    elif kind == "nan":
        ws[2][39, 63] = float("nan")  # poisons the whole group
    elif kind == "zero":
        ws = [torch.zeros_like(w) for w in ws]  # amax 0: S_enc 1
    elif kind == "tiny":
        ws = [w * 1e-40 for w in ws]  # float32-subnormal amax: S_enc clamped to FLT_MAX
    return [w.to(dtype).to(DEV) for w in ws]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["plain", "inf", "nan", "zero", "tiny"])
def test_group_amax_bits_give_the_torch_group_bits(kind, dtype):
    ws = _members(kind, dtype)
    hopper = get_backend("hopper")
    handle = hopper.group_scale(ws)
    assert isinstance(handle, GroupAmaxBits) and handle.bits.dtype == torch.int32 and handle.bits.numel() == 1
    want_scale = shared_global_encode_scale(w.cpu() for w in ws)
    assert torch.equal(get_backend("torch").group_scale([w.cpu() for w in ws]).nan_to_num(-1), want_scale.nan_to_num(-1))
    if kind == "zero":
        assert float(want_scale) == 1.0
    # member order does not change the bits (atomic max)
    assert torch.equal(hopper.group_scale(ws[::-1]).bits, handle.bits)
    for w in ws:
        got, gs = fake_quantize_weight_triton(w, dtype, handle)
        want, want_gs = fake_quantize_weight_reference(w.cpu(), dtype, want_scale)
        assert_same_bits(got, want)
        assert gs.shape == () and torch.equal(gs.cpu().nan_to_num(-1), want_gs.nan_to_num(-1))
        again, _ = fake_quantize_weight_triton(w, dtype, gs)  # the backward's recomputation
        assert_same_bits(again, got)


def test_group_amax_bits_refuse_expert_weights():
    ws = [torch.randn(2, 8, 32, device=DEV)]
    with pytest.raises(ValueError, match="amax_bits"):
        fake_quantize_weight_triton(ws[0], None, get_backend("hopper").group_scale(ws))


def _trainer(backend: str, dtype):
    model = quads.quantize_(build("llama", dtype=dtype), quads.QuadsPolicy(side="trainer")).to(DEV)
    chosen = get_backend(backend)
    for m in model.modules():
        if isinstance(m, TrainerModule):
            m.quads_backend = chosen  # the kernels on CPU tensors under the interpreter
    return model


def _step(model, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
        out = model(IDS.to(DEV), labels=IDS.to(DEV))
    out.loss.backward()
    return out.logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32-autocast", "bf16"])
def test_trainer_group_mode_kernel_path_is_the_torch_bits(dtype, autocast, monkeypatch):
    """Logits and master gradients of a group-mode trainer on the kernels (the parent's pre-hook
    makes the group's amax bits, each member's fused pass derives S_enc from them) and on the
    torch references, bit for bit; a member called alone takes the same path."""
    kernel, torch_ref = _trainer("hopper", dtype), _trainer("torch", dtype)
    made = []
    real = type(get_backend("hopper")).group_scale
    monkeypatch.setattr(type(get_backend("hopper")), "group_scale",
                        lambda self, masters, *rest: made.append(real(self, masters, *rest)) or made[-1])
    got, want = _step(kernel, autocast), _step(torch_ref, autocast)
    assert len(made) == 4 and all(isinstance(h, GroupAmaxBits) for h in made)  # once per group's parent
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and len(got[1]) > 0
    for n in got[1]:
        assert torch.equal(got[1][n], want[1][n]), n
    attn = "model.layers.0.self_attn"
    x = torch.randn(3, 64, dtype=dtype, device=DEV)
    with torch.no_grad():
        y = kernel.get_submodule(f"{attn}.k_proj")(x)
        y_ref = torch_ref.get_submodule(f"{attn}.k_proj")(x)
    assert len(made) == 5 and torch.equal(y.cpu(), y_ref.cpu())
