"""Bit-for-bit snapshots of a model, to test that a refused operation changed nothing."""

import torch

from quads.tensor import NVFP4Tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":  # no values: compare the shape
        return torch.tensor(list(t.shape))
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def snapshot(model: torch.nn.Module) -> dict:
    """Every parameter's and buffer's bytes (packed parts included), its identity, and every
    module's class and quads attributes."""
    state = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = p.parts if isinstance(p, NVFP4Tensor) else (p,)
        state[f"param:{name}"] = (id(p), type(p), [_bytes(t) for t in parts])
    for name, b in model.named_buffers(remove_duplicate=False):
        state[f"buffer:{name}"] = (id(b), type(b), [_bytes(b)])
    for name, m in model.named_modules():
        state[f"module:{name}"] = (type(m), sorted(k for k in vars(m) if k.startswith("quads_")))
    return state


def assert_unchanged(before: dict, model: torch.nn.Module) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    changed = []
    for key, (a, b) in ((k, (before[k], after[k])) for k in before):
        if key.startswith("module:"):
            same = a == b
        else:
            same = a[0] == b[0] and a[1] is b[1] and len(a[2]) == len(b[2]) and all(
                torch.equal(x, y) for x, y in zip(a[2], b[2]))
        if not same:
            changed.append(key)
    assert not changed, f"changed: {changed[:8]}"
