"""Which executed line of sync_weights_ leaves quads' sync locks unusable from another thread."""
import copy, sys, threading, torch, quads
sys.path.insert(0, "/work/main")
from benchmarks.studies.reliability_sweeps import run_traced, _count_lines
from benchmarks.studies.reliability_sweeps import tiny_model
from quads.policies import sync_lock
trainer = tiny_model(seed=1, dtype=torch.float32); quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
base = tiny_model(); quads.quantize_(base, quads.QuadsPolicy(side="rollout"))
op = lambda m: quads.sync_weights_(m, trainer)
total = _count_lines(op, base)
bad = []
lo, hi = int(sys.argv[1]), int(sys.argv[2])
for n in range(lo, min(hi, total) + 1):
    r = copy.deepcopy(base)
    run_traced(lambda: op(r), stop=n)
    torch.set_grad_enabled(True)
    ok = []
    t = threading.Thread(target=lambda: (quads.sync_weights_(r, trainer), ok.append(1)), daemon=True)
    t.start(); t.join(10)
    if not ok: bad.append(n); print("stuck after interrupt at line", n, flush=True)
print("total", total, "scanned", lo, "..", min(hi, total), "stuck", len(bad), bad[:10])
