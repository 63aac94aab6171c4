"""Measured humming tuning configurations per GPU: the shipped table and its merge into humming's own.

humming picks a GEMM configuration per M interval (entry ``[lo, hi, cfg]`` for ``lo < M <= hi``)
from its heuristics. ``benchmarks/ops/tune_humming.py`` times candidate configurations on a GPU and
writes the faster ones to ``quads/assets/humming_tuned/<device>.json`` (``<device>``:
:func:`device_slug` of ``torch.cuda.get_device_name``). :class:`~quads.ops.backends.humming.library.HummingNVFP4`
reads it: for a layer's (device, N, K, dtype, mode, experts) the tuned entries replace humming's
on their M intervals; the rest of humming's table stays (:func:`merge_tuned`).

**File** (``format`` :data:`TABLE_FORMAT`): ``{"format", "device", "humming", "entries": [{"n",
"k", "dtype", "mode", "experts", "intervals": [[lo, hi, cfg], ...]}, ...]}`` (an entry may add a
free-form ``"measured"``). ``humming`` must be :data:`HUMMING_REQUIREMENT` (configurations are
humming-version specific); ``mode`` is ``"default"`` or ``"no_stream_k"`` (whose configurations
must have ``use_stream_k`` false); ``"batch_invariant"`` layers never read the table.

**Errors**: a file that does not validate raises one line naming the file and the problem (a
shipped table is written by the script; a broken one is a packaging bug, not a slower kernel to
hide).

**Which table** (:func:`tuned_choice`): ``"shipped"`` (the file above, if there is one), ``"off"``
or a named file (its ``device`` must still match). The humming backend decides it once, when it
is made (``HummingBackend(tuned=...)``, default ``QUADS_HUMMING_TUNED``: :func:`tuned_from_env`)
and hands it down to each layer; the lookups here take it as an argument and never read the
environment. Nothing here imports humming.
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import lru_cache
from pathlib import Path

__all__ = ["HUMMING_REQUIREMENT", "OFF", "SHIPPED", "TABLE_FORMAT", "TUNED_DIR", "TUNED_MODES", "device_slug",
           "load_table", "merge_tuned", "table_path", "tuned_choice", "tuned_from_env", "tuned_intervals",
           "validate_table"]

TABLE_FORMAT = "quads-humming-tuned/1"
HUMMING_REQUIREMENT = "humming-kernels==0.1.19"  # the humming quads runs (the library module re-exports it)
TUNED_DIR = Path(__file__).resolve().parents[3] / "assets" / "humming_tuned"  # quads/assets/humming_tuned
TUNED_MODES = ("default", "no_stream_k")
M_MAX = 1 << 30  # humming's last interval ends here
#: the fields of humming 0.1.19's ``TuningConfig``, plus ``num_sms`` and ``use_f16_accum`` (its heuristic
#: entries carry them; its kernel preparation reads them)
TUNING_KEYS = frozenset((
    "mma_type", "block_shape", "warp_shape", "use_stream_k", "use_f16_accum", "wgmma_use_late_as",
    "wgmma_split_issue_wait", "num_stages", "producer_stage_unroll", "consumer_stage_unroll",
    "producer_registers", "num_ctas_per_sm", "umma_num_dequant_warpgroups", "umma_cta_group_size",
    "output_chunk_rows", "use_warp_spec", "use_tma", "use_tma_a", "use_tma_as", "use_tma_as2", "use_tma_b",
    "use_tma_c", "use_tma_bs", "use_tma_bs2", "use_tma_bzp", "use_tma_bias", "smem_reuse_mode",
    "multi_cast_size_a", "multi_cast_size_b", "use_pdl", "raster_group_m", "evict_weights_first", "num_sms"))
DTYPES = ("float16", "bfloat16")
SHIPPED, OFF = "shipped", "off"  # the table choices besides a named file (an absolute path)


def device_slug(name: str) -> str:
    """A device name as a file name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def tuned_choice(tuned) -> str:
    """A table choice as layers store it: :data:`SHIPPED` (``True`` or ``"shipped"``), :data:`OFF`
    (``False`` or ``"off"``), or a named file (any other str or ``os.PathLike``) as an absolute path."""
    if tuned is True or tuned == SHIPPED:
        return SHIPPED
    if tuned is False or tuned == OFF:
        return OFF
    if isinstance(tuned, (str, os.PathLike)) and str(tuned):
        return os.path.abspath(Path(tuned).expanduser())
    raise ValueError(f"tuned must be True/'shipped', False/'off' or a table file's path, got {tuned!r}")


def tuned_from_env() -> str:
    """The table choice ``QUADS_HUMMING_TUNED`` names (unset or ``1``: the shipped table, ``0``: off,
    else a file): what :class:`~quads.ops.backends.humming.backend.HummingBackend` reads when it is made."""
    env = os.environ.get("QUADS_HUMMING_TUNED", "")
    if env in ("", "1"):
        return SHIPPED
    return OFF if env == "0" else tuned_choice(env)


def table_path(device_name: str, tuned=SHIPPED) -> Path | None:
    """The table file of choice ``tuned`` (:func:`tuned_choice`) for ``device_name`` (None: off)."""
    tuned = tuned_choice(tuned)
    if tuned == OFF:
        return None
    return TUNED_DIR / f"{device_slug(device_name)}.json" if tuned == SHIPPED else Path(tuned)


def _check_cfg(cfg, mode: str, where: str) -> None:
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a configuration must be an object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - TUNING_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown configuration fields {unknown}")
    for name in ("block_shape", "warp_shape"):
        v = cfg.get(name)
        if not (isinstance(v, list) and len(v) == 3 and all(type(x) is int and x > 0 for x in v)):
            raise ValueError(f"{where}: {name} must be 3 positive integers, got {v!r}")
    for name, v in cfg.items():
        if not (v is None or isinstance(v, (bool, int, str)) or name in ("block_shape", "warp_shape")):
            raise ValueError(f"{where}: field {name} must be a JSON scalar, got {v!r}")
    if mode == "no_stream_k" and cfg.get("use_stream_k", True) is not False:
        raise ValueError(f"{where}: a no_stream_k configuration must have use_stream_k false")


def _check_intervals(intervals, mode: str, where: str) -> None:
    if not isinstance(intervals, list) or not intervals:
        raise ValueError(f"{where}: intervals must be a non-empty list of [lo, hi, cfg]")
    last = -1
    for i, entry in enumerate(intervals):
        at = f"{where} interval {i}"
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and type(entry[1]) is int):
            raise ValueError(f"{at}: must be [lo, hi, cfg] with integer bounds, got {entry!r}"[:300])
        lo, hi, cfg = entry
        if not 0 <= lo < hi <= M_MAX or lo < last:
            raise ValueError(f"{at}: bounds ({lo}, {hi}] must rise, without overlap, within (0, 2^30]")
        last = hi
        _check_cfg(cfg, mode, at)


def validate_table(data, device_name: str) -> None:
    """Raise ValueError (the problem, one line) unless ``data`` is a valid table for ``device_name``."""
    if not isinstance(data, dict):
        raise ValueError("the table must be a JSON object")
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"format must be {TABLE_FORMAT!r}, got {data.get('format')!r}")
    if data.get("humming") != HUMMING_REQUIREMENT:
        raise ValueError(f"measured with {data.get('humming')!r}, quads runs {HUMMING_REQUIREMENT!r}")
    if data.get("device") != device_name:
        raise ValueError(f"measured on {data.get('device')!r}, this device is {device_name!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError("entries must be a list")
    seen = set()
    for j, e in enumerate(entries):
        where = f"entry {j}"
        if not isinstance(e, dict) or set(e) - {"measured"} != {"n", "k", "dtype", "mode", "experts", "intervals"}:
            raise ValueError(f"{where}: must hold exactly n, k, dtype, mode, experts, intervals (and measured)")
        if not all(type(e[f]) is int and e[f] > 0 for f in ("n", "k")):
            raise ValueError(f"{where}: n and k must be positive integers")
        if e["dtype"] not in DTYPES or e["mode"] not in TUNED_MODES:
            raise ValueError(f"{where}: dtype must be one of {DTYPES} and mode one of {TUNED_MODES}")
        if e["experts"] is not None and not (type(e["experts"]) is int and e["experts"] > 0):
            raise ValueError(f"{where}: experts must be null or a positive integer")
        key = (e["n"], e["k"], e["dtype"], e["mode"], e["experts"])
        if key in seen:
            raise ValueError(f"{where}: a second entry for {key}")
        seen.add(key)
        _check_intervals(e["intervals"], e["mode"], where)


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, device_name: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        validate_table(data, device_name)
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"humming tuned table {path}: {err} (QUADS_HUMMING_TUNED=0 or tuned=False turns it "
                         "off)") from None
    return {(e["n"], e["k"], e["dtype"], e["mode"], e["experts"]): e["intervals"] for e in data["entries"]}


def load_table(device_name: str, tuned=SHIPPED) -> dict:
    """(n, k, dtype, mode, experts) -> intervals of ``device_name``'s table of choice ``tuned``
    (:func:`tuned_choice`); {} when there is none (or it is off). Read once per file version."""
    tuned = tuned_choice(tuned)
    path = table_path(device_name, tuned)
    if path is None:
        return {}
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        if tuned != SHIPPED:  # a named file must be there
            raise ValueError(f"humming tuned table {path}: no such file (QUADS_HUMMING_TUNED / tuned=)") from None
        return {}
    return _load(str(path), mtime, device_name)


def tuned_intervals(device_name: str, n: int, k: int, dtype: str, mode: str, experts: int | None,
                    tuned=SHIPPED) -> list | None:
    """The tuned ``[lo, hi, cfg]`` entries for one layer from the table of choice ``tuned``, or None
    (none; ``batch_invariant``)."""
    if mode not in TUNED_MODES:
        return None
    return load_table(device_name, tuned).get((n, k, dtype, mode, experts))


def merge_tuned(table: list, tuned: list) -> list:
    """humming's M-interval ``table`` with ``tuned``'s entries in place of its own on their
    intervals (an M served by a tuned entry gets its cfg, every other M what ``table`` gave it).
    Adjacent pieces of one source entry are joined; neither input is modified."""
    bounds = sorted({b for entry in (*table, *tuned) for b in entry[:2]})
    out = []
    for lo, hi in zip(bounds, bounds[1:]):  # every M in (lo, hi] lies in the same entries: hi stands for them
        src = next((e for e in tuned if e[0] < hi <= e[1]), None) or next(
            (e for e in table if e[0] < hi <= e[1]), None)
        if src is None:
            continue
        if out and out[-1][3] is src and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi, src[2], src])
    return [[lo, hi, copy.deepcopy(cfg)] for lo, hi, cfg, _ in out]

