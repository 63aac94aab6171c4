"""A sibling set's one kernel (quads.ops.sibling_linear.SiblingSet): made once, one GEMM per set,
and the launchers three calls below a member's forward.

Runs the Hopper backend's kernels under the Triton interpreter (tests/conftest.py) on a Llama
whose projection rows are multiples of 64 (the stacked layout's row tile).
"""

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quads
import quads.kernels.hopper.w4a4_decode as w4a4_decode
from quads.ops.backends.hopper import HopperSiblingKernel
from quads.policies.fused_projections import share_quantization
from quads.policies.modules import RolloutLinear

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's 1/0 on zero scales
    pytest.mark.usefixtures("memo_weight_kernel"),  # the weight quantizer kernel runs once per distinct weight
]


def _rollout(fuse: bool, **policy):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=32,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with quads.use_backend("hopper"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", **policy))
    if fuse:
        assert quads.fuse_projections_(model) == 2
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_set_kernel_is_made_once_and_reused(monkeypatch):
    made = []
    real_init = HopperSiblingKernel.__init__

    def counted(self, siblings):
        made.append(siblings)
        real_init(self, siblings)

    monkeypatch.setattr(HopperSiblingKernel, "__init__", counted)
    model = _rollout(fuse=True)
    sets = {id(m.quads_group): m.quads_group for m in model.modules()
            if isinstance(m, RolloutLinear) and m.quads_group is not None}
    # per set: one when it was made (no forward makes one), one over its stacked layout
    assert len(made) == 4 and sorted(id(s) for s in made) == sorted(list(sets) * 2)
    kernels = {i: s.kernel() for i, s in sets.items()}
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        _logits(model, ids)
    assert len(made) == 4 and all(s.kernel() is kernels[i] for i, s in sets.items())
    group = model.model.layers[0].self_attn.q_proj.quads_group
    group.stacked = type(group.stacked)(group.stacked.values, group.stacked.scales, group.stacked.n, group.stacked.k)
    assert group.kernel() is kernels[id(group)]  # nothing polled: a forward keeps the kernel until the refresh
    group.refresh_kernel()
    assert group.kernel() is not kernels[id(group)] and len(made) == 5  # a source replaced: remade


@pytest.mark.parametrize("fuse", [True, False])
def test_one_decode_gemm_per_stacked_set(monkeypatch, fuse):
    """Decode-sized inputs: q/k/v one GEMM, gate/up one (fused), and the bits of seven."""
    calls, inside = [0], [False]
    real = w4a4_decode.decode_gemm

    def counted(*args, **kwargs):  # outermost calls only (under the interpreter it calls itself for bf16)
        if inside[0]:
            return real(*args, **kwargs)
        calls[0], inside[0] = calls[0] + 1, True
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] = False

    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(2))
    want = _logits(_rollout(fuse=False), ids)
    model = _rollout(fuse=fuse)
    monkeypatch.setattr(w4a4_decode, "decode_gemm", counted)
    got = _logits(model, ids)
    assert calls[0] == (4 if fuse else 7) and torch.equal(got, want)


LAUNCHERS = {"quantize_rows", "scaled_fp16_rows", "decode_gemm", "w4a4_gemm"}


def _launcher_depths(model, run) -> set[tuple[bool, int]]:
    """(whether the linear is in a sibling set, calls from its ``forward`` to each outermost
    launcher (the launch is one more))."""
    forward = RolloutLinear.forward.__code__
    depths: set[int] = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name not in LAUNCHERS or "quads/kernels/" not in frame.f_code.co_filename:
            return
        depth, f = 1, frame.f_back
        while f is not None and f.f_code is not forward:
            if f.f_code.co_name in LAUNCHERS and "quads/kernels/" in f.f_code.co_filename:
                return  # called from inside a launcher: not the outermost
            depth, f = depth + 1, f.f_back
        if f is not None:
            depths.add((f.f_locals["self"].quads_group is not None, depth))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return depths


@pytest.mark.parametrize("case", ["stacked", "prefill", "dormant", "w4a16"])
def test_launchers_are_three_calls_below_a_member_forward(monkeypatch, case):
    """forward -> the member's kernel -> the set's or its own kernel.apply -> launcher (-> the
    launch): 4 calls on every sibling path."""
    if case == "prefill":
        monkeypatch.setattr(w4a4_decode, "max_decode_columns", lambda: 0)
    model = _rollout(fuse=case != "dormant", **({"activations": "bf16"} if case == "w4a16" else {}))
    ids = torch.randint(0, 64, (1, 2), generator=torch.Generator().manual_seed(3))

    def run():
        with torch.no_grad(), share_quantization(model):
            model(ids)

    assert _launcher_depths(model, run) == {(True, 3), (False, 2)}  # o_proj / down_proj: forward -> kernel.apply -> launcher
