"""Session 6 experiment (dropped): the trainer's sibling groups as one autograd Function and one
GEMM. Host time of a 4-layer Llama trainer's forward + backward with the fake-quant kernels
stubbed (GPU-path glue, no interpreter), stacked vs per member, and the gradient difference.

    git worktree add --detach /tmp/stack 632a595 && cd /tmp/stack   # the patch's base commit
    git apply lab/stacked_siblings/stacked_siblings.patch
    python -m lab.stacked_siblings.host_time
"""

import os
import statistics
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import quads  # noqa: E402
from quads.kernels import fake_quantize_nvfp4 as fq  # noqa: E402
from quads.ops.backend_registry import get_backend  # noqa: E402
from quads.policies.modules import TrainerModule  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


class _FillOut:  # the fused pass's output made finite (CPU GEMMs on uninitialized memory are slow)
    def __getitem__(self, grid):
        return lambda *a, **k: a[6].fill_(0.01)


def main():
    torch.set_num_threads(1)
    hopper = get_backend("hopper")
    cls = type(hopper)
    if not hasattr(cls, "trainer_stacked_siblings"):
        raise SystemExit("apply lab/stacked_siblings/stacked_siblings.patch first")
    fq._fake_quant_amax_kernel, fq._fake_quant_kernel = _NoLaunch(), _FillOut()
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    for m in model.modules():
        if isinstance(m, TrainerModule):
            m.quads_backend = hopper
    peer = LlamaForCausalLM(cfg).float()
    ids = torch.randint(0, 96, (1, 4))

    def run(m):
        m(ids).logits.float().sum().backward()

    def timed(m, n=100):
        t0 = time.perf_counter()
        for _ in range(n):
            run(m)
        return (time.perf_counter() - t0) / n * 1e6

    for _ in range(30):
        run(model), run(peer)
    res = {"stacked": [], "per member": [], "bf16 peer": []}
    for _ in range(12):  # interleaved rounds: a shared machine's load hits every row alike
        for stacked, name in ((True, "stacked"), (False, "per member")):
            cls.trainer_stacked_siblings = stacked
            res[name].append(timed(model))
        res["bf16 peer"].append(timed(peer))
    print(f"# lab.stacked_siblings.host_time: 4-layer Llama fwd+bwd, kernels stubbed, torch {torch.__version__}")
    for name, v in res.items():
        print(f"{name:12s} min {min(v):8.0f} us   median {statistics.median(v):8.0f} us")


if __name__ == "__main__":
    main()
