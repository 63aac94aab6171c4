"""The reliability sweeps of ``docs/reliability.md``: faults injected at every point, counted.

    python -m benchmarks.studies.reliability_sweeps            # sampled (a few minutes on 2 CPU cores)
    python -m benchmarks.studies.reliability_sweeps --full     # every point (about an hour on 2 CPU cores)
    python -m benchmarks.studies.reliability_sweeps --full --write-docs   # and replace the table in docs/reliability.md

Each sweep injects one kind of fault many times and counts the outcomes that break a promise:

* ``quantize_ interrupt``: a ``KeyboardInterrupt`` raised at the N-th executed Python line (every
  frame: quads, torch, transformers) inside ``quantize_``, trainer and rollout side, for every N
  (``--full``) or a sample; the model must afterwards be exactly as before (classes, attributes,
  hooks, parameters) or completely converted, and a retry must give the converted model;
* ``sync interrupt``: the same inside ``sync_weights_``: the rollout exactly as before, or synced;
* ``concurrent syncs``: threads syncing different trainers into one rollout at once; the rollout
  must end as exactly one trainer's sync (a torn rollout mixes two);
* ``safetensors bit flips`` / ``export bit flips``: one bit flipped in a file ``save_safetensors``
  or ``export_modelopt`` wrote; loading must raise (``load_safetensors`` / ``load_exported``);
* ``kill -9``: a child process killed at a random moment while it saves a file / exports; the
  target must then be the old file or the complete new one (absent for an export), never half;
* ``planted links``: a symlink planted at every name a writer of the project uses (the target,
  ``X.tmp``, the write probe) pointing at a canary file; the canary must stay unchanged;
* ``export races``: two exports to one ``--out`` started together; one must succeed and the other
  refuse in one line, and the folder must load.

The tests in ``tests/reliability/`` call these functions with small samples (CI); this script
runs them with the sizes below and prints the table docs/reliability.md holds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import dataclasses
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn

import quads

# -- models -------------------------------------------------------------------------------------


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A 2-layer Qwen3-MoE from config (random weights): layer 0 fused MoE experts, layer 1 a
    dense MLP, so both sibling groups (q/k/v, gate/up), the experts and a tied embedding occur."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, intermediate_size=64,
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                         tie_word_embeddings=True)
    return Qwen3MoeForCausalLM(cfg).to(dtype)


# -- what a model is: everything quantize_ / sync_weights_ may change ------------------------------


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def tensor_state(model: nn.Module) -> dict[str, tuple]:
    """Every parameter's and buffer's bytes (packed parts included), by name."""
    from quads.tensor import NVFP4Tensor

    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = p.parts if isinstance(p, NVFP4Tensor) else (p,)
        out[name] = (type(p).__name__, p.dtype, tuple(_bytes(t) for t in parts))
    for name, b in model.named_buffers(remove_duplicate=False):
        out[f"buffer:{name}"] = (type(b).__name__, b.dtype, (_bytes(b),))
    return out


def structure(model: nn.Module) -> dict[str, tuple]:
    """Per module: its class name, its attribute names, its hook counts, and which parameter
    objects it holds (ties); and whether ``save_pretrained`` is the model's own."""
    ids: dict[int, int] = {}
    out = {}
    for name, m in model.named_modules():
        hooks = tuple(sorted((k, len(v)) for k, v in vars(m).items() if k.endswith("hooks") and isinstance(v, dict)))
        params = tuple(ids.setdefault(id(p), len(ids)) for p in m._parameters.values() if p is not None)
        out[name] = (type(m).__name__, tuple(sorted(vars(m))), hooks, params)
    out["<save_pretrained>"] = "save_pretrained" in vars(model)
    return out


def same_objects(model: nn.Module) -> dict[str, int]:
    """id of every parameter and buffer by name (an untouched model keeps its objects)."""
    return {n: id(p) for n, p in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))}


# -- interrupts at every executed line --------------------------------------------------------------


class _LineCounter:
    """A trace function counting executed lines in every frame; raises KeyboardInterrupt at
    line ``stop`` (then Python removes it)."""

    def __init__(self, stop: int | None = None):
        self.stop, self.count = stop, 0

    def __call__(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.stop:
                raise KeyboardInterrupt(f"injected at executed line {self.stop}")
        return self


def run_traced(fn: Callable[[], object], stop: int | None = None) -> tuple[int, BaseException | None]:
    """Run ``fn`` under a :class:`_LineCounter`; (lines executed, the exception or None). The
    garbage collector is off during the run (after collecting what earlier work left): a
    finalizer run by a collection inside ``fn`` would count lines that are not ``fn``'s, and
    Python drops an exception raised in a finalizer, so an interrupt landing there would vanish."""
    counter = _LineCounter(stop)
    error = None
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.settrace(counter)
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the injected interrupt, or what it caused
        error = err
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()
    return counter.count, error


def _count_lines(fn: Callable[[nn.Module], object], base: nn.Module) -> int:
    """Lines ``fn(copy of base)`` executes, counted on a second run (the first fills caches)."""
    fn(copy.deepcopy(base))
    model = copy.deepcopy(base)
    total, error = run_traced(lambda: fn(model))
    if error is not None:
        raise error
    return total


@dataclasses.dataclass
class SweepResult:
    name: str
    tried: int
    bad: int
    outcomes: dict[str, int]
    examples: list[str]

    def row(self) -> str:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return f"| {self.name} | {self.tried} | {self.bad} | {shown} |"


def _sample(total: int, points: int | None, seed: int, tail: int = 0) -> list[int]:
    """1..total (``points`` None), or ``points`` of them: the first, every one of the last
    ``tail`` lines (where a conversion's model-level finishing runs: hooks, attributes), and a
    random rest."""
    every = list(range(1, total + 1))
    if points is None or points >= total:
        return every
    chosen = {1, *every[max(total - tail, 0):]}
    rest = [n for n in every if n not in chosen]
    chosen.update(random.Random(seed).sample(rest, max(min(points - len(chosen), len(rest)), 0)))
    return sorted(chosen)


def quantize_interrupt_sweep(side: str, points: int | None = None, seed: int = 0, tail: int = 0) -> SweepResult:
    """Ctrl-C at executed line N of ``quantize_`` (see the module doc); ``points``: a sample."""
    policy = quads.QuadsPolicy(side=side)
    base = tiny_model()
    reference = copy.deepcopy(base)
    quads.quantize_(reference, policy)
    want_structure, want_tensors = structure(reference), tensor_state(reference)
    before_structure, before_tensors = structure(base), tensor_state(base)
    def op(model):
        quads.quantize_(model, policy)

    total = _count_lines(op, base)
    outcomes: dict[str, int] = {}
    examples = []
    lines = _sample(total, points, seed, tail)
    for n in lines:
        model = copy.deepcopy(base)
        objects = same_objects(model)
        _, error = run_traced(lambda: op(model), stop=n)
        grad_ok = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        if error is not None and not isinstance(error, KeyboardInterrupt):
            kind = f"other error {type(error).__name__}"
        elif error is None:  # the line ran after quantize_ returned (a finalizer): it must be done
            kind = "converted" if structure(model) == want_structure and tensor_state(model) == want_tensors \
                else "half-converted"
        elif structure(model) == before_structure and tensor_state(model) == before_tensors \
                and same_objects(model) == objects:
            kind = "unchanged"
        elif structure(model) == want_structure and tensor_state(model) == want_tensors:
            kind = "converted"
        else:
            kind = "half-converted"
        if kind == "unchanged":  # a retry must give the converted model
            quads.quantize_(model, policy)
            if structure(model) != want_structure or tensor_state(model) != want_tensors:
                kind = "retry differs"
        if not grad_ok:
            kind = "grad mode left off"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind not in ("unchanged", "converted") and len(examples) < 5:
            examples.append(f"line {n}: {kind}")
    bad = sum(v for k, v in outcomes.items() if k not in ("unchanged", "converted"))
    return SweepResult(f"Ctrl-C in quantize_ ({side}), executed line N of {total}", len(lines), bad, outcomes,
                       examples)


def sync_interrupt_sweep(points: int | None = None, seed: int = 0) -> SweepResult:
    """Ctrl-C at executed line N of ``sync_weights_``: the rollout as before, or synced."""
    trainer = tiny_model(seed=1, dtype=torch.float32)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    base = tiny_model()
    quads.quantize_(base, quads.QuadsPolicy(side="rollout"))
    reference = copy.deepcopy(base)
    quads.sync_weights_(reference, trainer)
    want, before = tensor_state(reference), tensor_state(base)
    def op(model):
        quads.sync_weights_(model, trainer)

    total = _count_lines(op, base)
    outcomes: dict[str, int] = {}
    examples = []
    lines = _sample(total, points, seed)
    for n in lines:
        rollout = copy.deepcopy(base)
        _, error = run_traced(lambda: op(rollout), stop=n)
        torch.set_grad_enabled(True)
        state = tensor_state(rollout)
        if error is not None and not isinstance(error, KeyboardInterrupt):
            kind = f"other error {type(error).__name__}"
        else:  # (no error: the line ran after the sync returned, in a finalizer)
            kind = "unchanged" if state == before and error is not None else "synced" if state == want else "torn"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind not in ("unchanged", "synced") and len(examples) < 5:
            examples.append(f"line {n}: {kind}")
    bad = sum(v for k, v in outcomes.items() if k not in ("unchanged", "synced"))
    return SweepResult(f"Ctrl-C in sync_weights_, executed line N of {total}", len(lines), bad, outcomes, examples)


# -- concurrent syncs ----------------------------------------------------------------------------


def concurrent_sync_sweep(trials: int = 10, threads: int = 2, syncs: int = 1, seed: int = 0) -> SweepResult:
    """``threads`` threads, each syncing its own trainer into one rollout ``syncs`` times, started
    together, the interpreter switching threads every microsecond (``sys.setswitchinterval``)
    so that their write phases interleave; after each trial the rollout must be exactly one
    trainer's sync (without the lock, 2 threads x 1 sync tore about one trial in seven)."""
    trainers = []
    for i in range(threads):
        t = tiny_model(seed=100 + i, dtype=torch.float32)
        quads.quantize_(t, quads.QuadsPolicy(side="trainer"))
        trainers.append(t)
    base = tiny_model(seed=seed)
    quads.quantize_(base, quads.QuadsPolicy(side="rollout"))
    expected = []
    for t in trainers:
        r = copy.deepcopy(base)
        quads.sync_weights_(r, t)
        expected.append(tensor_state(r))
    outcomes: dict[str, int] = {}
    examples = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(trials):
            _race_once(base, trainers, expected, syncs, trial, outcomes, examples)
    finally:
        sys.setswitchinterval(interval)
    bad = sum(v for k, v in outcomes.items() if k != "one trainer's sync")
    return SweepResult(f"concurrent syncs ({threads} threads x {syncs} syncs, one rollout)", trials, bad, outcomes,
                       examples)


def _race_once(base, trainers, expected, syncs, trial, outcomes, examples) -> None:
    """One trial of :func:`concurrent_sync_sweep`; adds its outcome to ``outcomes``."""
    rollout = copy.deepcopy(base)
    start = threading.Barrier(len(trainers))
    errors = []

    def work(trainer):
        try:
            start.wait()
            for _ in range(syncs):
                quads.sync_weights_(rollout, trainer)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    pool = [threading.Thread(target=work, args=(t,)) for t in trainers]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    state = tensor_state(rollout)
    if errors:
        kind = f"error {type(errors[0]).__name__}"
    elif any(state == e for e in expected):
        kind = "one trainer's sync"
    else:
        torn = [n for n in state if not any(state[n] == e[n] for e in expected)]
        sources = {i for n in state for i, e in enumerate(expected) if state[n] == e[n] and n not in torn}
        kind = "torn"
        if len(examples) < 5:
            examples.append(f"trial {trial}: {len(torn)} weights torn (parts of two trainers), the others from "
                            f"{len(sources)} trainers")
    outcomes[kind] = outcomes.get(kind, 0) + 1


# -- bit flips in saved files ----------------------------------------------------------------------


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _same_state(a: dict, b: dict) -> bool:
    from quads.tensor import NVFP4Tensor

    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if type(x) is not type(y) or x.dtype != y.dtype or x.shape != y.shape:
            return False
        xs = x.parts if isinstance(x, NVFP4Tensor) else (x,)
        ys = y.parts if isinstance(y, NVFP4Tensor) else (y,)
        if not all(_bytes(p) == _bytes(q) for p, q in zip(xs, ys)):
            return False
    return True


def safetensors_bitflip_sweep(flips: int = 100, seed: int = 0) -> SweepResult:
    """One random bit flipped in a rollout state saved by ``save_safetensors``, ``flips`` times;
    ``load_safetensors`` must raise, or give exactly the saved state (a flip in header padding)."""
    from quads.tensor import load_safetensors, save_safetensors
    from quads.tensor.files import write_atomically

    rollout = tiny_model()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollout.safetensors"
        save_safetensors(rollout.state_dict(), path)
        data = path.read_bytes()
        original = load_safetensors(path)
        rng = random.Random(seed)
        outcomes: dict[str, int] = {}
        examples = []
        for _ in range(flips):
            bit = rng.randrange(len(data) * 8)
            write_atomically(path, _flip(data, bit))
            try:
                state = load_safetensors(path)
            except Exception:  # noqa: BLE001 - any refusal counts as caught
                kind = "refused"
            else:
                kind = "loaded, same state" if _same_state(state, original) else "loaded, changed"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind == "loaded, changed" and len(examples) < 5:
                examples.append(f"bit {bit} (byte {bit // 8} of {len(data)})")
    return SweepResult(f"bit flips in a save_safetensors file ({len(data)} bytes)", flips,
                       outcomes.get("loaded, changed", 0), outcomes, examples)


def _export(out: Path, seed: int = 0) -> None:
    from quads.integrations.modelopt import export_modelopt

    export_modelopt(tiny_model(seed=seed, dtype=torch.float32), out, "w4a16")


def export_bitflip_sweep(flips: int = 100, seed: int = 0, full_loads: int = 0) -> SweepResult:
    """One random bit flipped in a random file of a ``quads export`` folder, ``flips`` times.
    The load (``load_exported``'s first step: every file against the recorded checksums) must
    refuse, unless the flip is in the report outside its checksums and every file the model is
    read from is unchanged; the first ``full_loads`` flips also run the whole ``load_exported``."""
    from quads.integrations.modelopt import load_exported
    from quads.tensor.files import write_atomically
    from quads.tensor.modelopt_format import EXPORT_REPORT, verify_checksums

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        _export(out)
        files = sorted(p for p in out.rglob("*") if p.is_file())
        original = {p: p.read_bytes() for p in files}
        sizes = [len(original[p]) * 8 for p in files]
        rng = random.Random(seed)
        outcomes: dict[str, int] = {}
        examples = []
        for i in range(flips):
            bit = rng.randrange(sum(sizes))
            for p, n in zip(files, sizes):
                if bit < n:
                    break
                bit -= n
            write_atomically(p, _flip(original[p], bit))
            try:
                if i < full_loads:
                    load_exported(out)
                else:
                    if not verify_checksums(out):
                        raise ValueError("no checksums recorded")
            except Exception:  # noqa: BLE001 - any refusal counts as caught
                kind = "refused"
            else:
                changed = [q.name for q in files if q.name != EXPORT_REPORT and q.read_bytes() != original[q]]
                kind = "loaded, changed" if changed else "loaded, same files (flip in the report)"
                if changed and len(examples) < 5:
                    examples.append(f"{p.name} bit {bit}")
            write_atomically(p, original[p])
            outcomes[kind] = outcomes.get(kind, 0) + 1
    total = sum(sizes) // 8
    return SweepResult(f"bit flips in a quads export ({len(files)} files, {total} bytes)", flips,
                       outcomes.get("loaded, changed", 0), outcomes, examples)


# -- kill -9 while writing ---------------------------------------------------------------------


def _forked(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child (exit status 0, 1 on an exception); returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            torch.set_num_threads(1)
            work()
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    return pid


def _kill_after(pid: int, seconds: float) -> int:
    """SIGKILL ``pid`` after ``seconds`` (if it still runs); its wait status."""
    import signal

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.001)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


def save_kill_sweep(kills: int = 10, seed: int = 0, max_delay: float = 0.05) -> SweepResult:
    """A child saving two states in turn to one path, ``save_safetensors`` in a loop, is killed
    with SIGKILL at a random moment, ``kills`` times; the file must then load as one of them."""
    from quads.tensor import load_safetensors, save_safetensors

    states = []
    for s in (0, 1):
        r = tiny_model(seed=s)
        quads.quantize_(r, quads.QuadsPolicy(side="rollout"))
        states.append(r.state_dict())
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    examples = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.safetensors"
        save_safetensors(states[0], path)

        def loop():
            i = 0
            while True:
                save_safetensors(states[i % 2], path)
                i += 1

        for k in range(kills):
            _kill_after(_forked(loop), rng.uniform(0.0, max_delay))
            try:
                state = load_safetensors(path)
                kind = "whole (old or new)" if any(_same_state(state, s) for s in states) else "changed"
            except Exception as err:  # noqa: BLE001
                kind = f"unreadable ({type(err).__name__})"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind != "whole (old or new)" and len(examples) < 5:
                examples.append(f"kill {k}: {kind}")
        leftovers = [p.name for p in Path(tmp).iterdir() if p.name != path.name]
    outcomes["temporary files left"] = len(leftovers)
    return SweepResult("kill -9 during save_safetensors", kills, kills - outcomes.get("whole (old or new)", 0),
                       outcomes, examples)


def export_kill_sweep(kills: int = 3, seed: int = 0) -> SweepResult:
    """A child running ``export_modelopt`` is killed with SIGKILL at a random moment of its run
    (uniform over 1.2x the time an export takes here); the folder must then be absent or a
    complete export (every checksum verifies), and the next export to it must remove what the
    killed one left."""
    from quads.integrations.modelopt.export import stale_temp_dirs
    from quads.tensor.modelopt_format import verify_checksums

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        _kill_after(_forked(lambda: _export(Path(tmp) / "export")), 600.0)
        max_delay = 1.2 * (time.perf_counter() - started)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    examples = []
    for k in range(kills):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "export"
            status = _kill_after(_forked(lambda: _export(out)), rng.uniform(0.0, max_delay))
            if not out.exists():
                kind = "absent"
            else:
                try:
                    kind = "complete" if verify_checksums(out) else "no checksums"
                except ValueError as err:
                    kind = f"broken ({err})"
            with __import__("warnings").catch_warnings():
                __import__("warnings").simplefilter("ignore")
                stale_temp_dirs(out)  # what the next export does first
            left = [p.name for p in Path(tmp).iterdir() if p.name != "export"]
            if left:
                kind += ", temp dir left"
            if os.WIFEXITED(status) and kind == "complete":
                kind = "complete (finished before the kill)"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if not kind.startswith(("absent", "complete")) and len(examples) < 5:
                examples.append(f"kill {k}: {kind}")
    bad = sum(v for key, v in outcomes.items() if not key.startswith(("absent", "complete")) or "left" in key)
    return SweepResult("kill -9 during export_modelopt", kills, bad, outcomes, examples)


# -- two exports to one folder ------------------------------------------------------------------


def export_race_sweep(trials: int = 2, seed: int = 0) -> SweepResult:
    """Two forked exports to one ``--out``, started together; one must finish, the other refuse
    with FileExistsError (exit 3 here), and the folder must verify."""
    from quads.tensor.modelopt_format import verify_checksums

    outcomes: dict[str, int] = {}
    examples = []
    for t in range(trials):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "export"
            go_r, go_w = os.pipe()

            def racer(s):
                def work():
                    os.read(go_r, 1)
                    try:
                        _export(out, seed=s)
                    except FileExistsError:
                        os._exit(3)
                return work

            pids = [_forked(racer(s)) for s in (0, 1)]
            os.write(go_w, b"xx")
            codes = sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids)
            os.close(go_r)
            os.close(go_w)
            try:
                whole = verify_checksums(out) > 0
            except (ValueError, OSError):
                whole = False
            kind = f"exit codes {codes}, folder {'whole' if whole else 'broken'}"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if (codes != [0, 3] or not whole) and len(examples) < 5:
                examples.append(f"trial {t}: {kind}")
    good = sum(v for k, v in outcomes.items() if k == "exit codes [0, 3], folder whole")
    return SweepResult("two exports racing to one --out", trials, trials - good, outcomes, examples)


# -- planted symlinks ------------------------------------------------------------------------------


def _writers() -> dict[str, tuple[str, Callable[[Path], None]]]:
    """name -> (the file name it writes in a directory, a function writing it there): every
    kind of writer the project has (the helpers every benchmark, example and CLI uses, and the
    places that write on their own)."""
    import importlib.util

    from benchmarks.timing import append_results
    from quads.diagnostics.cli_inputs import atomic_write_text, check_output_dir, check_output_file
    from quads.tensor import save_safetensors
    from quads.tensor.files import atomic_path, open_for_append, write_atomically

    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example",
                                                  Path(__file__).resolve().parents[2] / "examples" / "trl_grpo_quads.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def fig():
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        f, ax = plt.subplots()
        ax.plot([0, 1])
        return f

    def append(d):
        with open_for_append(d / "metrics.jsonl") as f:
            f.write("{}\n")

    def diagnose_json(d):
        check_output_file(str(d / "report.json"))
        atomic_write_text(d / "report.json", "{}")

    def save_model(d):
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        spec2 = importlib.util.spec_from_file_location(
            "build_default_model", Path(__file__).resolve().parents[2] / "examples" / "build_default_model.py")
        builder = importlib.util.module_from_spec(spec2)
        spec2.loader.exec_module(builder)
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
        builder.save_model_files(d, tiny_model(), tok, {"seed": 0})

    def atomic_named(d):
        from safetensors.torch import save_file

        with atomic_path(d / "shard.safetensors") as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))

    return {
        "save_safetensors": ("state.safetensors", lambda d: save_safetensors({"x": torch.ones(4)}, d / "state.safetensors")),
        "write_atomically (benchmarks' JSON)": ("bench.json", lambda d: write_atomically(d / "bench.json", "{}")),
        "atomic_path (named writers)": ("shard.safetensors", atomic_named),
        "diagnose --json (probe + write)": ("report.json", diagnose_json),
        "output-dir probe": (f".quads-write-probe-{os.getpid()}", lambda d: check_output_dir(str(d))),
        "example summary.json": ("summary.json", lambda d: example.write_summary(d, {"complete": False})),
        "example metrics.csv": ("metrics.csv", lambda d: example.write_csv([{"step": 1}], d / "metrics.csv")),
        "example plot": ("reward_gap.png", lambda d: example.save_figure(fig(), d / "reward_gap.png")),
        "metrics.jsonl append": ("metrics.jsonl", append),
        "kernels.csv append": ("kernels.csv", lambda d: append_results([{"kernel": "k", "us": 1.0}], "raw",
                                                                         csv_path=d / "kernels.csv")),
        "export --out": ("export", lambda d: _export(d / "export")),
        "model files (save_pretrained + build_info)": ("model.safetensors", save_model),
    }


def planted_link_sweep(only: Iterable[str] | None = None) -> SweepResult:
    """For every writer, a symlink planted at the name it writes and at ``name.tmp``, pointing
    at a canary file and at a path that does not exist (a dangling link); after the writer ran
    (or refused), the canary must hold its bytes and the dangling target must not exist."""
    from quads.tensor.files import write_atomically

    writers = _writers()
    outcomes: dict[str, int] = {}
    examples = []
    tried = 0
    for label, (name, write) in writers.items():
        if only is not None and label not in only:
            continue
        for planted in (name, f"{name}.tmp"):
            for dangling in (False, True):
                tried += 1
                with tempfile.TemporaryDirectory() as tmp:
                    d = Path(tmp) / "out"
                    d.mkdir()
                    canary = Path(tmp) / "canary"
                    if not dangling:
                        write_atomically(canary, b"precious")
                    (d / planted).symlink_to(canary)
                    try:
                        write(d)
                        result = "written"
                    except Exception as err:  # noqa: BLE001 - a refusal is fine, a followed link is not
                        result = f"refused ({type(err).__name__})"
                    followed = canary.exists() if dangling else canary.read_bytes() != b"precious"
                kind = "followed" if followed else result
                outcomes[kind] = outcomes.get(kind, 0) + 1
                if followed and len(examples) < 5:
                    examples.append(f"{label}: link at {planted}{' (dangling)' if dangling else ''}")
    return SweepResult(f"planted links ({len(writers)} writers x 2 names x 2 kinds)", tried,
                       outcomes.get("followed", 0), outcomes, examples)


# -- the script ------------------------------------------------------------------------------------

#: sweep -> (sampled kwargs, full kwargs)
SIZES: dict[str, tuple[Callable[..., SweepResult], dict, dict]] = {
    "quantize_ interrupt (trainer)": (quantize_interrupt_sweep, dict(side="trainer", points=300, tail=100),
                                      dict(side="trainer")),
    "quantize_ interrupt (rollout)": (quantize_interrupt_sweep, dict(side="rollout", points=300, tail=100),
                                      dict(side="rollout")),
    "sync_weights_ interrupt": (sync_interrupt_sweep, dict(points=300), dict()),
    "concurrent syncs": (concurrent_sync_sweep, dict(trials=10, threads=3, syncs=3),
                         dict(trials=100, threads=4, syncs=5)),
    "safetensors bit flips": (safetensors_bitflip_sweep, dict(flips=500), dict(flips=10000)),
    "export bit flips": (export_bitflip_sweep, dict(flips=500, full_loads=3), dict(flips=10000, full_loads=20)),
    "kill -9 in save_safetensors": (save_kill_sweep, dict(kills=30), dict(kills=500)),
    "kill -9 in export": (export_kill_sweep, dict(kills=10), dict(kills=200)),
    "planted links": (planted_link_sweep, dict(), dict()),
    "export races": (export_race_sweep, dict(trials=5), dict(trials=50)),
}

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability_sweeps: begin -->", "<!-- reliability_sweeps: end -->"


def run_all(full: bool, only: Iterable[str] | None = None, log=print) -> list[tuple[SweepResult, float]]:
    results = []
    for name, (fn, sampled, every) in SIZES.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        result = fn(**(every if full else sampled))
        took = time.perf_counter() - started
        log(f"{result.row()}  ({took:.0f} s)" + (f"  e.g. {result.examples}" if result.examples else ""))
        results.append((result, took))
    return results


def table(results: list[tuple[SweepResult, float]], full: bool) -> str:
    import quads as q

    cmd = "python -m benchmarks.studies.reliability_sweeps" + (" --full" if full else "")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    lines = [f"`{cmd}` (quads {q.__version__}, {machine}; "
             f"{sum(t for _, t in results):.0f} s in all):", "",
             "| sweep | tried | promise broken | outcomes |", "|---|---|---|---|"]
    lines += [r.row() for r, _ in results]
    return "\n".join(lines)


def write_docs(text: str) -> None:
    from quads.tensor.files import write_atomically

    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block to replace")
    head, rest = doc.split(BEGIN, 1)
    write_atomically(DOC, head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every interrupt point and the large counts (see SIZES)")
    ap.add_argument("--only", nargs="+", choices=list(SIZES), default=None, help="run only these sweeps")
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table in {DOC.name}")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = run_all(args.full, args.only)
    text = table(results, args.full)
    print("\n" + text)
    if args.write_docs:
        write_docs(text)
        print(f"\nwrote the table into {DOC}")
    return 1 if any(r.bad for r, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
