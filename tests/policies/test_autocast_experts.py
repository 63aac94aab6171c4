"""The ``bf16`` plan is BF16 on both sides for MoE trainers: unquantized experts under autocast.

transformers' ``grouped_mm`` experts ignore autocast; :func:`quads.prepare_trainer_` switches a
trainer's unquantized experts to the autocast dtype (``bf16``), and ``bf16-fp32-experts`` keeps
the FP32 expert GEMMs as an ablation. The gap test trains FP32 masters (exactly BF16 values at
the start) with Adam at a learning rate below a BF16 step per update and re-syncs a BF16
rollout copy after each step. The tiny Mixtral routes every token to all its experts (top-4 of
4): no top-k flip makes the gap jump, so what moves it is the precision of the GEMMs.
"""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MixtralConfig, MixtralForCausalLM

import quads
from quads.policies import build_rollout_model, quantized_modules, sync_weights_
from quads.policies.autocast_experts import AUTOCAST_GROUPED_MM
from tests.tiny_models import COMMON

STEPS = 6


def moe_masters(seed: int = 0) -> MixtralForCausalLM:
    """A tiny Mixtral with non-uniform outputs, FP32 masters holding BF16 values, grouped_mm experts."""
    torch.manual_seed(seed)
    cfg = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=4)
    cfg._experts_implementation = "grouped_mm"
    model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)  # default init is near-uniform: ~0 gap whatever the precision
    return model.to(torch.bfloat16).float()


def _token_logprobs(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _gap(trainer, rollout, ids) -> float:
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp_t = _token_logprobs(trainer, ids)
        lp_r = _token_logprobs(rollout, ids)
    return (lp_r - lp_t).abs().mean().item()


def gap_curve(preset: str, steps: int = STEPS, lr: float = 3e-5) -> list[float]:
    """Rollout-vs-trainer mean |Δ log p| (teacher forced) before each step and after the last.

    The matmul weights train (embeddings and norm gains, elementwise FP32 in every plan's
    trainer, stay fixed)."""
    trainer = quads.prepare_trainer_(moe_masters(), preset)
    rollout = build_rollout_model(trainer, None, dtype=torch.bfloat16)
    ids = torch.randint(0, trainer.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(1))
    params = [p for n, p in trainer.named_parameters() if p.dim() >= 2 and "embed" not in n]
    opt = torch.optim.Adam(params, lr=lr)
    curve = []
    for _ in range(steps):
        curve.append(_gap(trainer, rollout, ids))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = trainer(input_ids=ids).logits[:, :-1].float()
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        sync_weights_(rollout, trainer)
    curve.append(_gap(trainer, rollout, ids))
    return curve


def test_bf16_gap_stays_at_its_first_step_level():
    curve = gap_curve("bf16")
    assert max(curve[1:]) <= 1.3 * curve[0], curve


def test_fp32_experts_ablation_drifts():
    curve = gap_curve("bf16-fp32-experts")
    later = sum(curve[2:]) / len(curve[2:])
    assert later >= 1.35 * curve[0], curve


class _GroupedMMDtypes(TorchDispatchMode):
    """The dtypes of the (activation, weight) operands of every grouped GEMM run inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "grouped_mm" in func.__name__:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _grouped_mm_dtypes(model, autocast: bool = True, backward: bool = False):
    ids = torch.arange(1, 9)[None]
    with _GroupedMMDtypes() as mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids).logits.float().sum()
        if backward:
            out.backward()
    return set(mode.seen)


def test_trainer_experts_multiply_in_the_autocast_dtype():
    trainer = quads.prepare_trainer_(moe_masters(), "bf16")
    assert trainer.config._experts_implementation == AUTOCAST_GROUPED_MM
    assert _grouped_mm_dtypes(trainer, backward=True) == {(torch.bfloat16, torch.bfloat16)}
    grad = trainer.model.layers[0].mlp.experts.gate_up_proj.grad
    assert grad is not None and grad.dtype == torch.float32  # the gradient reaches the FP32 master
    ablation = quads.prepare_trainer_(moe_masters(), "bf16-fp32-experts")
    assert _grouped_mm_dtypes(ablation) == {(torch.float32, torch.float32)}  # transformers' grouped_mm


def test_unchanged_without_autocast_in_bf16_and_in_the_rollout():
    fp32 = moe_masters()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        before = fp32(input_ids=ids).logits
        quads.prepare_trainer_(fp32, "bf16")
        assert _grouped_mm_dtypes(fp32, autocast=False) == {(torch.float32, torch.float32)}
        assert torch.equal(fp32(input_ids=ids).logits, before)
        bf16 = moe_masters().to(torch.bfloat16)
        before = bf16(input_ids=ids).logits
        quads.prepare_trainer_(bf16, "bf16")
        assert torch.equal(bf16(input_ids=ids).logits, before)
    rollout = build_rollout_model(fp32, None)
    assert rollout.config._experts_implementation == "grouped_mm"  # capturable, BF16 without autocast


def test_quantized_experts_keep_their_forward():
    trainer = quads.prepare_trainer_(moe_masters(), "quads")
    assert any(name.endswith("experts") for name in quantized_modules(trainer))
    assert trainer.config._experts_implementation == "grouped_mm"  # nothing left for transformers' experts
