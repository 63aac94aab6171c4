"""`quads diagnose` end to end on a tiny saved MoE (CLI, JSON, rows, ordering)."""

import json

import pytest

import quads
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from quads.cli import main
from quads.diagnostics.diagnose import ROWS
from quads.diagnostics.recommend import PLAN_TABLE
from quads.policies import POLICY_PRESETS
from tests.tiny_models import build


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    build("qwen3_moe").save_pretrained(path)
    vocab = {chr(97 + i): i for i in range(26)} | {"[PAD]": 90, "[EOS]": 91, "[UNK]": 92}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]").save_pretrained(path)
    return str(path)


def test_diagnose_cli_reports_every_config(saved_model, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["diagnose", "--model", saved_model, "--max-new-tokens", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    not_run = {r["config"]: r["reason"] for r in report["not_run"]}
    assert list(rows) == [r.name for r in ROWS if r.name not in not_run]
    assert list(not_run) == ["quads-boundary"] and "keeps all 2 decoder layers" in not_run["quads-boundary"]
    # every plan is a row; the FP32-experts ablation is the probe lines (a BF16 trainer has no autocast)
    assert {r.preset for r in ROWS} - {None} == set(POLICY_PRESETS) - {"bf16-fp32-experts"}
    assert rows["quads-100"]["preset"] == "quads" and rows["quads-50"]["preset"] is None
    assert report["model_kind"] == "moe"
    assert [r["hardware"] for r in report["recommendations"]] == ["hopper", "blackwell"]  # a CPU run: every GPU kind
    assert report["completion_tokens"] > 0
    # residual compensation shrinks the gap monotonically in k; the floor is the smallest
    assert rows["quads-75"]["gap_mean"] < rows["quads-50"]["gap_mean"] < rows["quads-25"]["gap_mean"] < rows["w4a16-qat"]["gap_mean"]
    assert rows["bf16-floor"]["gap_mean"] < rows["quads-50"]["gap_mean"]
    assert report["layer_residual_fraction"] == quads.POLICY_PRESETS["quads"].rollout.residual_fraction == 1.0
    assert all(l["rel_err_k100"] < l["rel_err_k0"] for l in report["layers"])
    # routing flips per row (an MoE model): shares, and the naive W4A4 rollout flips more than the floor
    assert all(0.0 <= r["routing_flip_top1"] <= 1.0 and 0.0 <= r["routing_flip_topk"] <= 1.0 for r in rows.values())
    assert rows["naive"]["routing_flip_topk"] > rows["bf16-floor"]["routing_flip_topk"]
    printed = capsys.readouterr().out
    assert "flips" in printed.splitlines()[2]
    assert "quads-50" in printed and "layer input" in printed
    assert "+100% res" in printed and "+50% res" not in printed  # the layer table follows the default policy
    assert "quads-boundary" in printed and "not run" in printed
    assert "recommended plan (hopper, moe model): " in printed
    assert PLAN_TABLE in printed  # where every plan's measured gap, accuracy and speed are
    # transformers' default grouped_mm experts: FP32 GEMMs under autocast, caught; quads' bf16 plan: none
    probe = report["precision_probe"]
    assert "model.layers.0.mlp.experts: trainer float32, rollout bfloat16" in probe["transformers"]
    assert probe["quads"] is None
    assert "FP32 masters under BF16 autocast, transformers: quads precision probe: 2 module(s)" in printed
    assert "FP32 masters under BF16 autocast, quads: every unconverted module multiplies in bfloat16" in printed


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_engine_steps_of_several_tokens_give_token_by_token_log_probs(kind):
    """`--tokens-per-step` only changes how many tokens a cached forward takes: same bits."""
    import torch

    import quads
    from quads.diagnostics.scoring import score_incremental

    model = build(kind)
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding
    one = score_incremental(model, ids, attn, 8)
    for step in (3, 16):
        assert torch.equal(score_incremental(model, ids, attn, 8, tokens_per_step=step), one)
    with pytest.raises(ValueError, match="tokens_per_step"):
        score_incremental(model, ids, attn, 8, tokens_per_step=0)


def test_diagnose_plans_scores_only_the_named_rows_and_announces_them(saved_model, tmp_path, capsys):
    """``--plans``: the named rows (a preset name selects its row) plus the BF16 floor, and up front
    how many rows and passes, then a time estimate."""
    out = tmp_path / "report.json"
    assert main(["diagnose", "--model", saved_model, "--max-new-tokens", "4", "--plans", "w4a16,quads",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["rows"]] == ["bf16-floor", "quads-100", "w4a16"]
    err = capsys.readouterr().err
    assert "3 row(s) (bf16-floor, quads-100, w4a16): 3 rollout + 2 trainer scoring passes" in err
    assert "estimate: about" in err


def test_diagnose_unknown_plan_is_one_line_before_any_work(saved_model, tmp_path, capsys):
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "--model", saved_model, "--plans", "w4a16,quadz", "--json", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--plans" in err and "unknown plan 'quadz'" in err and "w4a16-experts" in err
    assert not out.exists()


def test_run_diagnose_refuses_an_unknown_plan_before_sampling():
    """The Python API checks ``plans`` first: the model is never run (a None model would fail later)."""
    from quads.diagnostics.diagnose import run_diagnose

    with pytest.raises(ValueError, match=r"^diagnose plans: unknown plan 'nope'; choose from bf16-floor, "):
        run_diagnose(None, None, ["x"], plans=["nope"])
