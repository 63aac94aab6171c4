"""Fused sibling projections (q/k/v, gate/up as one stacked decode GEMM): same bits as unfused.

Runs the Hopper backend's kernels (under the Triton interpreter on CPU) on a real transformers
Llama whose projection rows are multiples of 64 (the stacked layout's row tile).
"""

import pytest
import torch

import quads
from quads.policies import build_rollout_model, unfuse_projections_
from quads.policies.modules import RolloutLinear
from tests.tiny_models import square_llama

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's 1/0 on zero scales
    pytest.mark.usefixtures("memo_weight_kernel"),  # the weight quantizer kernel runs once per distinct weight (tests/conftest.py)
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _llama(seed=0):
    return square_llama(seed).to(DEV)


def _rollout(seed=0):
    model = _llama(seed)
    with quads.use_backend("hopper"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_fused_model_has_the_unfused_bits():
    fused, plain = _rollout(), _rollout()
    assert quads.fuse_projections_(fused) == 2  # q/k/v and gate/up of the one layer
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.quads_group is attn.k_proj.quads_group is attn.v_proj.quads_group
    assert attn.q_proj.quads_group.stacked is not None  # Hopper, W4A4, rows of 64: one stacked GEMM
    ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(1)).to(DEV)
    assert torch.equal(_logits(fused, ids), _logits(plain, ids))


def test_members_alone_and_in_any_order_give_their_own_bits():
    fused, plain = _rollout(), _rollout()
    quads.fuse_projections_(fused)
    fa, pa = fused.model.layers[0].self_attn, plain.model.layers[0].self_attn
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    with torch.no_grad():
        assert torch.equal(fa.k_proj(x), pa.k_proj(x))  # first call: computes the group, serves k
        assert torch.equal(fa.v_proj(x), pa.v_proj(x))  # served from the group's outputs
        assert torch.equal(fa.q_proj(x), pa.q_proj(x))
        x.add_(1.0)  # written in place: the version counter moves, nothing stale is served
        assert torch.equal(fa.q_proj(x), pa.q_proj(x))
        x.mul_(0.5)
        assert torch.equal(fa.k_proj(x), pa.k_proj(x))
        assert torch.equal(fa.q_proj(x), pa.q_proj(x))  # q already served for this input: recomputed
        long = torch.randn(1, 80, 64, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
        assert torch.equal(fa.v_proj(long), pa.v_proj(long))  # prefill-sized: each member alone


def test_sync_writes_the_stacked_layout_in_place():
    trainer = _llama(seed=5)
    with quads.use_backend("hopper"):  # build_rollout_model fuses on the Hopper backend
        rollout = build_rollout_model(trainer, quads.QuadsPolicy(side="rollout"), device=DEV)
    group = rollout.model.layers[0].self_attn.q_proj.quads_group
    assert group is not None
    ptr, scales_ptr = group.stacked.values.data_ptr(), group.row_scales.data_ptr()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    quads.sync_weights_(rollout, trainer, plain_trainer=True)
    assert group.stacked.values.data_ptr() == ptr and group.row_scales.data_ptr() == scales_ptr
    with quads.use_backend("hopper"):
        reference = build_rollout_model(trainer, quads.QuadsPolicy(side="rollout"), device=DEV,
                                        fuse_projections=False)
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(6)).to(DEV)
    assert torch.equal(_logits(rollout, ids), _logits(reference, ids))
    q = rollout.model.layers[0].self_attn.q_proj
    assert torch.equal(group.row_scales[:64], q.weight.parts.global_encode_scale.float().expand(64))


def test_unfuse_and_what_does_not_fuse():
    model = _rollout()
    assert quads.fuse_projections_(model) == 2
    assert quads.fuse_projections_(model) == 0  # already grouped
    assert unfuse_projections_(model) == 2
    assert all(m.quads_group is None for m in model.modules() if isinstance(m, RolloutLinear))
    ref = quads.quantize_(_llama(), quads.QuadsPolicy(side="rollout"))  # the torch backend: no kernels
    if next(m for m in ref.modules() if isinstance(m, RolloutLinear)).quads_backend.name == "torch":
        assert quads.fuse_projections_(ref) == 2  # grouped: one quantization per input ...
        assert ref.model.layers[0].self_attn.q_proj.quads_group.stacked is None  # ... but no stacked GEMM
    w16 = _llama()
    with quads.use_backend("hopper"):
        quads.quantize_(w16, quads.QuadsPolicy(side="rollout", activations="bf16"))
    assert quads.fuse_projections_(w16) == 2
    assert w16.model.layers[0].self_attn.q_proj.quads_group.stacked is None  # weight-only: not stacked (W4A4 only)
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(7)).to(DEV)
    plain16 = _llama()
    with quads.use_backend("hopper"):
        quads.quantize_(plain16, quads.QuadsPolicy(side="rollout", activations="bf16"))
    assert torch.equal(_logits(w16, ids), _logits(plain16, ids))  # the shared fp16 operand: the same bits


def test_fusing_remakes_the_kernels_over_the_stacked_layout_at_once():
    """Each member's kernel reads its view of the stacked layout right after fusing (not remade at
    a later forward, which may run inside a compiled trace)."""
    model = _rollout()
    assert quads.fuse_projections_(model) == 2
    attn = model.model.layers[0].self_attn
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m.quads_kernel().args.prepared is m.quads_prepared[0]


def test_unfusing_remakes_the_kernels_over_their_own_layouts_at_once():
    """After unfusing, each member's kernel reads its own prepared copy right away (not remade at a
    later forward, which may run inside a compiled trace)."""
    model = _rollout()
    assert quads.fuse_projections_(model) == 2
    assert unfuse_projections_(model) == 2
    attn = model.model.layers[0].self_attn
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m.quads_kernel().args.prepared is m.quads_prepared[0]


def test_a_member_that_made_its_own_layout_keeps_it_when_the_set_dissolves(monkeypatch):
    """A member whose refresh made a new layout of its own (a device move: the old one does not
    fit) dissolves its set; it keeps the layout it made, its siblings get copies of their views,
    and every output keeps its bits."""
    model, plain = _rollout(), _rollout()
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(5))
    assert quads.fuse_projections_(model) == 2
    attn = model.model.layers[0].self_attn
    backend, made = attn.q_proj.quads_backend, []
    real = backend.prepare_weight
    monkeypatch.setattr(backend, "prepare_weight", lambda parts, out=None: made.append(real(parts, out)) or made[-1])
    attn.q_proj.quads_prepared = ()  # what a move to another device leaves: no layout that fits
    attn.q_proj.quads_weights_changed()
    assert len(made) == 1 and attn.q_proj.quads_prepared[0] is made[0]  # the one it made, not a copy of its view
    assert attn.q_proj.quads_kernel().args.prepared is made[0]
    assert all(m.quads_group is None for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert not attn._forward_pre_hooks  # the set's hooks left with it
    assert torch.equal(_logits(model, ids), _logits(plain, ids))
