"""Which part of a compiled trainer step leaves eager's bits on CUDA (session 6 diagnostic).

tests/policies/test_group_scale_once.py's GPU test found the compiled (aot_eager, fullgraph) trainer on the
kernel backend off eager's logits by a few bits. This separates the candidates, each compiled
with dynamo only (``eager``) and with AOT autograd (``aot_eager``):

* ``plain``: the tiny Llama without quads (cuBLAS under AOT's decompositions alone);
* ``torch`` / ``hopper``: quads' trainer on the reference / kernel backend;
* ``fq-group`` / ``fq-linear``: the kernel backend's group amax bits + fused fake quantization, and
  the trainer linear's forward and backward, on bare weights (no model around them).

    python -m lab.compile_bits            # CUDA only; prints one line per case
"""

import torch

import quads
from quads.ops.backend_registry import get_backend
from quads.policies.ste import fake_quant_linear, fake_quantize_weight
from tests.tiny_models import build

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))


def _diff(a, b):
    return "equal" if torch.equal(a, b) else f"max|diff| {(a.float() - b.float()).abs().max().item():.3e}"


def _model_step(model, fn, ids):
    model.zero_grad(set_to_none=True)
    out = fn(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def models():
    ids = IDS.cuda()
    for name in ("plain", "torch", "hopper"):
        model = build("llama", dtype=torch.float32).cuda()
        if name != "plain":
            with quads.use_backend(name):
                quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
        want = _model_step(model, model, ids)
        for cb in ("eager", "aot_eager"):
            torch._dynamo.reset()
            got = _model_step(model, torch.compile(model, backend=cb, fullgraph=True), ids)
            bad = [n for n in want[1] if not torch.equal(want[1][n], got[1][n])]
            print(f"model {name:6s} {cb:9s}: logits {_diff(want[0], got[0])}; grads differing {len(bad)}/{len(want[1])}"
                  + (f" e.g. {bad[0]} {_diff(want[1][bad[0]], got[1][bad[0]])}" if bad else ""), flush=True)


def bare():
    g = torch.Generator(device="cuda").manual_seed(0)
    hopper = get_backend("hopper")
    ws = [torch.randn(n, 64, device="cuda", generator=g) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.2))]
    x = torch.randn(5, 64, device="cuda", generator=g)

    def group(*ws):
        bits = hopper.group_scale(ws)
        return [fake_quantize_weight(w, hopper, torch.float32, bits) for w in ws]

    def linear(x, *ws):
        bits = hopper.group_scale(ws)
        return sum(fake_quant_linear(x, w, None, hopper, bits).sum() * (i + 1) for i, w in enumerate(ws))

    want = group(*ws)
    for cb in ("eager", "aot_eager"):
        torch._dynamo.reset()
        got = torch.compile(group, backend=cb, fullgraph=True)(*ws)
        print(f"fq-group  {cb:9s}: " + ", ".join(_diff(a, b) for a, b in zip(want, got)), flush=True)
    leaves = [w.clone().requires_grad_() for w in ws]
    xs = x.clone().requires_grad_()
    linear(xs, *leaves).backward()
    want = [xs.grad] + [w.grad for w in leaves]
    for cb in ("eager", "aot_eager"):
        torch._dynamo.reset()
        leaves2 = [w.clone().requires_grad_() for w in ws]
        xs2 = x.clone().requires_grad_()
        torch.compile(linear, backend=cb, fullgraph=True)(xs2, *leaves2).backward()
        got = [xs2.grad] + [w.grad for w in leaves2]
        print(f"fq-linear {cb:9s}: " + ", ".join(_diff(a, b) for a, b in zip(want, got)), flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("lab.compile_bits needs a CUDA GPU")
    for case in (models, bare):
        try:
            case()
        except Exception as e:  # noqa: BLE001  (a graph break or compile error is itself the answer)
            print(f"{case.__name__}: {type(e).__name__}: {str(e)[:400]}", flush=True)
