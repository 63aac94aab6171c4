"""Clear refusals: bad input is refused before any work, in one line that names the culprit
(exit status 2 from the command-line tools), and valid input is not refused."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import quads
from quads.cli import main
from tests.tiny_models import COMMON

REPO = Path(__file__).resolve().parents[2]


def _letters_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer of the letters a-z: digits and punctuation become [UNK]."""
    vocab = {chr(97 + i): i for i in range(26)} | {"[PAD]": 90, "[EOS]": 91, "[UNK]": 92}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def _model_dir(path: Path, **config) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 96, **config})).save_pretrained(path)
    _letters_tokenizer().save_pretrained(path)
    return path


def _prompts(path: Path, *lines: str) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_diagnosis(monkeypatch):
    import quads.diagnostics.diagnose as diagnose

    monkeypatch.setattr(diagnose, "run_diagnose", lambda *a, **k: pytest.fail("the diagnosis started"))


# -- shapes checked before any work ------------------------------------------------------------


def test_diagnose_refuses_k_not_a_multiple_of_16_before_sampling(tmp_path, capsys, no_diagnosis):
    model = _model_dir(tmp_path / "m", intermediate_size=72)  # down_proj has K = 72
    rc = main(["diagnose", "--model", str(model), "--prompts", _prompts(tmp_path / "p.txt", "abc")])
    line = _one_error_line(capsys)
    assert rc == 2 and "model.layers.0.mlp.down_proj.weight: input dim K=72" in line, line


def test_the_example_refuses_k_not_a_multiple_of_16_before_building_the_trainer(tmp_path):
    from quads.diagnostics.cli_inputs import UsageError

    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example", REPO / "examples" / "trl_grpo_quads.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = _model_dir(tmp_path / "m", intermediate_size=72)
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=r"down_proj\.weight: input dim K=72"):
        example.main(["--model", str(model), "--output-dir", str(out), "--max-steps", "1", "--eval-n", "0"])
    assert not out.exists()


# -- Hugging Face cache layout -----------------------------------------------------------------


def _as_hf_cache(export: Path, cache: Path) -> Path:
    """``export`` laid out as the Hugging Face cache stores a download: every file a symlink
    from ``models--org--name/snapshots/<revision>/`` into ``../../blobs/<hash>``."""
    repo = cache / "models--org--model"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(export.iterdir())):
        blob = repo / "blobs" / f"blob{i:03d}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_a_sharded_export_in_the_hf_cache_layout_loads(tmp_path):
    from quads.integrations.modelopt import export_modelopt, load_exported
    from quads.tensor.modelopt_format import read_modelopt_checkpoint

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 96}))
    export_modelopt(model, tmp_path / "export", "w4a16", max_shard_bytes=20_000)
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()
    snapshot = _as_hf_cache(tmp_path / "export", tmp_path / "hub")
    direct = read_modelopt_checkpoint(tmp_path / "export")
    cached = read_modelopt_checkpoint(snapshot)
    assert direct.keys() == cached.keys()
    loaded = load_exported(snapshot)
    reference = load_exported(tmp_path / "export")
    for (n, a), (_, b) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), n
    # a link leaving the cache's blobs is refused with its path
    shard = next(p for p in snapshot.iterdir() if p.name.startswith("model-00001"))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(ValueError, match=r"model-00001-of-\d+\.safetensors' resolves to .*elsewhere\.safetensors, "
                                         r"outside the checkpoint directory"):
        read_modelopt_checkpoint(snapshot)


# -- the tokenizer checked on the user's prompts ---------------------------------------------------


def test_diagnose_refuses_a_tokenizer_that_mangles_the_users_prompts(tmp_path, capsys, no_diagnosis):
    model = _model_dir(tmp_path / "m")
    rc = main(["diagnose", "--model", str(model), "--prompts", _prompts(tmp_path / "p.txt", "abc", "12+34=")])
    line = _one_error_line(capsys)
    assert rc == 2 and "encodes part of '12+34='" in line and "[UNK]" in line, line


def test_export_refuses_calibration_prompts_its_tokenizer_mangles(tmp_path, capsys):
    model = _model_dir(tmp_path / "m")
    calib = _prompts(tmp_path / "calib.txt", "hello", "7+8=")
    rc = main(["export", "--model", str(model), "--out", str(tmp_path / "out"), "--format", "nvfp4", "--calib", calib])
    line = _one_error_line(capsys)
    assert rc == 2 and "'7+8='" in line and "unknown token" in line, line
    assert not (tmp_path / "out").exists()


# -- one-line errors that name the input -----------------------------------------------------------


def test_wrong_argument_types_are_one_line_type_errors():
    with pytest.raises(TypeError, match=r"^quantize_ takes an nn\.Module as its model, got dict"):
        quads.quantize_({}, quads.QuadsPolicy(side="trainer"))
    with pytest.raises(TypeError, match=r"^fuse_projections_ takes an nn\.Module .*got str"):
        quads.fuse_projections_("x")


def test_a_numpy_number_is_a_residual_fraction():
    policy = quads.QuadsPolicy(side="rollout", residual_fraction=np.float32(0.25))
    assert type(policy.residual_fraction) is float and policy.residual_fraction == 0.25
    assert policy.activation_quant.residual_fraction == 0.25


def test_save_safetensors_into_a_missing_directory_names_the_directory(tmp_path):
    from quads.tensor import save_safetensors

    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=r"the directory .*no/such' does not exist") as err:
        save_safetensors({"x": torch.ones(2)}, missing / "a.safetensors")
    assert ".tmp" not in str(err.value)


def _small_export(tmp_path) -> Path:
    from quads.integrations.modelopt import export_modelopt

    torch.manual_seed(0)
    out = tmp_path / "export"
    export_modelopt(LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 96})), out, "w4a16")
    return out


def test_a_corrupt_export_config_names_the_file(tmp_path):
    from quads.integrations.modelopt import load_exported

    out = _small_export(tmp_path)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: checksum mismatch"):
        load_exported(out)
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_exported(out, verify=False)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, "two values"])
def test_a_bad_weight_scale_2_names_the_tensor(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    from quads.tensor.modelopt_format import read_modelopt_checkpoint

    out = _small_export(tmp_path)
    key = "model.layers.0.self_attn.o_proj.weight_scale_2"
    tensors = load_file(out / "model.safetensors")
    tensors[key] = torch.tensor([0.5, 0.5]) if bad == "two values" else torch.tensor(bad)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # as another tool writes it
    (out / "quads_export.json").unlink()  # (so no checksums either)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        read_modelopt_checkpoint(out)
