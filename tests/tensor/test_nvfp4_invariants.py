"""NVFP4Tensor checks its invariants at construction and on every load path (safetensors,
torch.load, load_state_dict / copy_), so a corrupt or hand-made state dict fails loudly."""

import io
import json

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from quads.tensor import NVFP4Tensor, load_safetensors, save_safetensors


def _t(*shape, granularity=None, seed=0):
    return NVFP4Tensor.from_float(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), granularity)


def _with_scale_byte(t, byte, index=(0, 0)):
    bits = t.scale.view(torch.uint8).clone()
    bits[index] = byte
    return bits.view(torch.float8_e4m3fn)


def test_scale_for_one_row_is_refused():
    t = _t(64, 32)
    with pytest.raises(ValueError, match=r"scale has shape \(1, 2\) but qdata \(64, 16\) needs \(64, 2\)"):
        NVFP4Tensor(t.qdata, t.scale[:1], t.global_encode_scale)


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0xC0, 0x81])  # NaN, NaN, -2.0, smallest negative subnormal
def test_nan_or_negative_block_scale_is_refused(byte):
    t = _t(8, 32)
    with pytest.raises(ValueError, match=r"block scale.*first at index \(0, 0\)"):
        NVFP4Tensor(t.qdata, _with_scale_byte(t, byte), t.global_encode_scale)
    NVFP4Tensor(t.qdata, _with_scale_byte(t, 0x80), t.global_encode_scale)  # -0.0 is a valid (zero) scale


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, float("inf")])
def test_nonpositive_or_nonfinite_global_scale_is_refused(value):
    t = _t(8, 32)
    with pytest.raises(ValueError, match="global_encode_scale must be finite and > 0"):
        NVFP4Tensor(t.qdata, t.scale, torch.tensor(value))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(orig_dtype=torch.int8), TypeError, "orig_dtype must be one of"),
    (dict(orig_dtype="bfloat16"), TypeError, "orig_dtype must be one of"),
    (dict(transposed="yes"), TypeError, "transposed must be a bool"),
    (dict(transposed=1), TypeError, "transposed must be a bool"),
])
def test_metadata_values_are_checked(kwargs, error, match):
    t = _t(8, 32)
    with pytest.raises(error, match=match):
        NVFP4Tensor(t.qdata, t.scale, t.global_encode_scale, **kwargs)


def test_part_dtypes_shapes_and_devices_are_checked():
    t, e = _t(8, 32), _t(4, 8, 32)
    with pytest.raises(TypeError, match="qdata must be uint8"):
        NVFP4Tensor(t.qdata.to(torch.int8), t.scale, t.global_encode_scale)
    with pytest.raises(TypeError, match="scale must be float8_e4m3fn"):
        NVFP4Tensor(t.qdata, t.scale.view(torch.uint8), t.global_encode_scale)
    with pytest.raises(TypeError, match="global_encode_scale must be float32"):
        NVFP4Tensor(t.qdata, t.scale, t.global_encode_scale.double())
    with pytest.raises(ValueError, match=r"global_encode_scale has shape \(3,\)"):
        NVFP4Tensor(e.qdata, e.scale, torch.ones(3))
    with pytest.raises(ValueError, match="K a multiple of 16"):
        NVFP4Tensor(t.qdata[:, :4], t.scale[:, :1], t.global_encode_scale)
    with pytest.raises(ValueError, match="parts on different devices"):
        NVFP4Tensor(t.qdata, t.scale.to("meta"), t.global_encode_scale)
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        NVFP4Tensor(t, t.scale, t.global_encode_scale)


def test_check_values_false_skips_only_the_value_checks():
    t = _t(8, 32)
    bad = _with_scale_byte(t, 0x7F)
    fast = NVFP4Tensor(t.qdata, bad, t.global_encode_scale, check_values=False)  # no device reduction
    assert torch.isnan(fast.dequantize()[0, :16]).all()
    with pytest.raises(ValueError, match="scale has shape"):
        NVFP4Tensor(t.qdata, t.scale[:1], t.global_encode_scale, check_values=False)


def test_granularities_and_copy_from_dense():
    for shape, gran, gs_shape in (((64, 32), "row", (64,)), ((4, 8, 32), "row", (4, 8)),
                                  ((4, 8, 32), None, (4,)), ((8, 32), None, ())):
        t = _t(*shape, granularity=gran)
        assert tuple(t.global_encode_scale.shape) == gs_shape
        assert t.granularity == (gran or ("expert" if len(shape) == 3 else "tensor"))
        new = torch.randn(*shape)
        t.copy_(new)
        assert torch.equal(t.dequantize(), NVFP4Tensor.from_float(new, gran).dequantize())


def test_copy_between_nvfp4_never_broadcasts_and_checks_the_source():
    dst = _t(64, 32, granularity="row")
    with pytest.raises(ValueError, match=r"global scales per tensor -> per row"):
        dst.copy_(_t(64, 32))
    src = _t(64, 32, granularity="row", seed=3)
    corrupt = NVFP4Tensor(src.qdata, _with_scale_byte(src, 0xFF, (5, 1)), src.global_encode_scale, check_values=False)
    kept = dst.qdata.clone()
    with pytest.raises(ValueError, match=r"copy_ source.*first at index \(5, 1\)"):
        dst.copy_(corrupt)
    assert torch.equal(dst.qdata, kept)
    dst.copy_(src)
    assert torch.equal(dst.dequantize(), src.dequantize())
    dense = torch.empty(64, 32)
    dense.copy_(src)  # NVFP4 -> dense dequantizes
    assert torch.equal(dense, src.dequantize())


def _lin():
    lin = nn.Linear(32, 8, bias=False)
    lin.weight = nn.Parameter(_t(8, 32), requires_grad=False)
    return lin


def test_load_state_dict_refuses_corrupt_packed_weight():
    lin = _lin()
    kept = lin.weight.scale.clone()
    w = _t(8, 32, seed=5)
    sd = {"weight": NVFP4Tensor(w.qdata, _with_scale_byte(w, 0x7F), w.global_encode_scale, check_values=False)}
    with pytest.raises(RuntimeError, match="NaN block scale"):  # torch wraps copy_'s ValueError
        lin.load_state_dict(sd)
    assert torch.equal(lin.weight.scale.view(torch.uint8), kept.view(torch.uint8))


def test_torch_load_checks_the_parts():
    t = _t(8, 32)
    t.scale.view(torch.uint8)[2, 1] = 0x7F  # corrupt after construction, as a bad file would be
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match=r"torch\.load.*first at index \(2, 1\)"):
        torch.load(buf, weights_only=True)


def _saved(tmp_path, state):
    path = tmp_path / "w.safetensors"
    save_safetensors(state, str(path))
    with safe_open(str(path), "pt") as f:
        return path, f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("field, value, match", [
    ("dtype", "int8", "metadata dtype must be one of"),
    ("dtype", "nn", "metadata dtype must be one of"),
    ("transposed", "yes", "metadata 'transposed' must be true or false"),
])
def test_safetensors_metadata_is_checked(tmp_path, field, value, match):
    _, meta, tensors = _saved(tmp_path, {"w": _t(8, 32)})
    nvfp4 = json.loads(meta["quads.nvfp4"])
    nvfp4["w"][field] = value
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata={"quads.nvfp4": json.dumps(nvfp4)})
    with pytest.raises(ValueError, match=f"NVFP4 weight 'w': {match}"):
        load_safetensors(str(path), verify=False)


def test_safetensors_without_checksums_still_checks_scales_and_parts(tmp_path):
    _, meta, tensors = _saved(tmp_path, {"w": _t(8, 32), "b": torch.zeros(8)})
    plain = {"quads.nvfp4": meta["quads.nvfp4"]}  # as another tool would write it: no checksums
    for key, edit, match in (
        ("w.scale", lambda s: s.index_fill_(0, torch.tensor([1]), 0x7F), "NaN block scale"),
        ("w.global_encode_scale", lambda g: g.fill_(0.0), "global_encode_scale must be finite and > 0"),
        ("w.scale", lambda s: s[:1].clone(), "scale has shape"),
    ):
        bad = dict(tensors)
        bad[key] = edit(tensors[key].clone())
        path = tmp_path / "bad.safetensors"
        save_file(bad, str(path), metadata=plain)
        with pytest.raises(ValueError, match=match):
            load_safetensors(str(path), verify=False)
        with pytest.raises(ValueError, match="no header checksum"):
            load_safetensors(str(path))  # unchecked loading is the caller's explicit choice
    missing = {k: v for k, v in tensors.items() if k != "w.qdata"}
    save_file(missing, str(tmp_path / "missing.safetensors"), metadata=plain)
    with pytest.raises(ValueError, match=r"the file has no w\.qdata"):
        load_safetensors(str(tmp_path / "missing.safetensors"), verify=False)
    save_file(tensors, str(tmp_path / "badjson.safetensors"), metadata={"quads.nvfp4": "{not json"})
    with pytest.raises(ValueError, match="not valid JSON"):
        load_safetensors(str(tmp_path / "badjson.safetensors"), verify=False)


def test_flipped_data_bit(tmp_path):
    """Documented behaviour: with quads' checksums a flipped qdata bit fails the load; without them
    it loads and changes exactly one element (nothing structural can catch it)."""
    t = _t(8, 32)
    path, meta, tensors = _saved(tmp_path, {"w": t})
    raw = bytearray(path.read_bytes())
    offset = raw.find(bytes(tensors["w.qdata"].reshape(-1)[:16].tolist()))
    assert offset > 0
    raw[offset + 3] ^= 0x40
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"checksum mismatch for 'w\.qdata'"):
        load_safetensors(str(flipped))
    bad = dict(tensors)
    bad["w.qdata"] = tensors["w.qdata"].clone()
    bad["w.qdata"].view(-1)[3] ^= 0x40
    save_file(bad, str(tmp_path / "nocrc.safetensors"), metadata={"quads.nvfp4": meta["quads.nvfp4"]})
    loaded = load_safetensors(str(tmp_path / "nocrc.safetensors"), verify=False)["w"]
    assert int((loaded.dequantize() != t.dequantize()).sum()) == 1


def _header_edit(path, edit):
    """The file with its JSON header edited to the same byte length (what a disk or a tool could do)."""
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + size].decode()
    new = edit(header)
    assert len(new) == len(header) and new != header, (header, new)
    raw[8:8 + size] = new.encode()
    return bytes(raw)


def _esc(text):
    """``text`` as it appears inside the header's JSON string values (quads.nvfp4 is JSON in JSON)."""
    return text.replace('"', '\\"')


def _swap(a, b):
    return lambda h: h.replace(a, b, 1)


def test_same_size_header_edits_fail_the_load(tmp_path):
    """The header checksum covers the header: same-size edits that would load a different
    state dict (or turn verification off) fail the load."""
    t = _t(16, 32)
    state = {"w": t, "sq": _t(32, 32), "dense": torch.ones(4, 8, dtype=torch.bfloat16),
             "emb": torch.arange(96, dtype=torch.float32).reshape(8, 12)}
    path = tmp_path / "m.safetensors"
    save_safetensors(state, str(path))
    loaded = load_safetensors(str(path))
    assert torch.equal(loaded["dense"], state["dense"]) and torch.equal(loaded["w"].qdata, t.qdata)
    edits = {
        "dtype BF16 -> F16": _swap('"dtype":"BF16"', '"dtype":"F16" '),
        "shape swapped": _swap('"shape":[8,12]', '"shape":[12,8]'),
        "transposed on a square weight": _swap(_esc('"sq": {"dtype": "float32", "transposed": false}'),
                                               _esc('"sq": {"dtype": "float32", "transposed": true} ')),
        "nvfp4 entry deleted": _swap(_esc('"sq": {'), _esc('"s_": {')),
        "crc key bit flip": _swap('"quads.crc32"', '"quads.crc33"'),
        "header crc key bit flip": _swap('"quads.header_crc32"', '"quads.header_crc33"'),
    }
    for what, edit in edits.items():
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(_header_edit(path, edit))
        with pytest.raises(ValueError, match="header checksum|no header checksum"):
            load_safetensors(str(bad))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "m.safetensors"]  # no temp left


def test_random_header_bit_flips_never_load_a_different_state(tmp_path):
    """Every random bit flip in the header fails the load (or leaves it unreadable): none loads
    a different state dict."""
    state = {"w": _t(16, 32), "b": torch.linspace(-1, 1, 8)}
    path = tmp_path / "m.safetensors"
    save_safetensors(state, str(path))
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    gen = torch.Generator().manual_seed(0)
    bad = tmp_path / "bad.safetensors"
    for bit in torch.randint(0, size * 8, (300,), generator=gen).tolist():
        flipped = bytearray(raw)
        flipped[8 + bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError):
            load_safetensors(str(bad))


def test_state_dict_entries_that_cannot_be_saved_or_loaded(tmp_path):
    """Bad inputs get a clear error: a None value and w (NVFP4) beside a dense w.qdata (an
    unloadable file otherwise) are refused with nothing written; a directory given to
    load_safetensors says it is a directory."""
    with pytest.raises(TypeError, match="'b' is NoneType"):
        save_safetensors({"w": _t(16, 32), "b": None}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match=r"also has w\.qdata"):
        save_safetensors({"w": _t(16, 32), "w.qdata": torch.zeros(3)}, str(tmp_path / "x.safetensors"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_safetensors(str(tmp_path))
