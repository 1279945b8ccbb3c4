"""HF <-> Megatron conversion (Megatron's dist_checkpointing format): bit-exact round trips, the CLI,
and clear errors on bad input."""
import json
import re
import shutil

import pytest
import torch
from megatron.core.dist_checkpointing import load_tensors_metadata
from safetensors.torch import load_file

from orz.convert import hf2mcore, main, mcore2hf
from orz.models.arch import ModelConfigError, read_arch
from orz.models.checkpoint import HFCheckpoint, read_megatron_meta, save_hf
from orz.models.tiny import make_tiny_hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("llama"), vocab_size=101)
    (path / "tokenizer_config.json").write_text("{}")  # stands in for tokenizer files
    return path


def _all_tensors(path):
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


LLAMA31 = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16})


@pytest.mark.parametrize("family,tied,extra", [("llama", False, {}), ("qwen2", True, {}), ("qwen3", False, dict(head_dim=32)),
                                               ("llama", True, LLAMA31)])
def test_round_trip_tp2_pp2_is_bit_exact(tmp_path, family, tied, extra):
    src = make_tiny_hf(tmp_path / "hf", family=family, vocab_size=101, tie_word_embeddings=tied, **extra)
    hf2mcore(str(src), str(tmp_path / "mcore"), tp=2, pp=2, vocab_divisible_by=8)
    meta = read_megatron_meta(tmp_path / "mcore")
    assert meta["layout"] | {"dp": 1} == {"tp": 2, "pp": 2, "dp": 1, "ep": 1, "etp": 1, "cp": 1}
    assert meta["padded_vocab"] == 112 and meta["optimizer"] is None  # 101 padded to a multiple of 8 × TP
    assert (tmp_path / "mcore" / ".metadata").is_file() and len(list((tmp_path / "mcore").glob("*.distcp"))) == 4
    mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "back"), like=str(src))
    original, back = load_file(src / "model.safetensors"), load_file(tmp_path / "back/model.safetensors")
    assert original.keys() == back.keys()
    for key in original:
        assert torch.equal(original[key], back[key]), key
    assert json.loads((tmp_path / "back/config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_sharded_hf_input_and_output_load_in_transformers(tmp_path, llama):
    from transformers import AutoModelForCausalLM

    tensors = _all_tensors(llama)
    config = json.loads((llama / "config.json").read_text())
    save_hf(tmp_path / "sharded", tensors.items(), config, extra_files_from=llama, max_shard_bytes=100_000)
    assert (tmp_path / "sharded/model.safetensors.index.json").is_file()
    hf2mcore(str(tmp_path / "sharded"), str(tmp_path / "mcore"), tp=2, pp=1)
    mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "back"), like=str(llama))
    assert (tmp_path / "back/tokenizer_config.json").is_file()
    tokens = torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(llama)(tokens).logits
        out = AutoModelForCausalLM.from_pretrained(tmp_path / "back")(tokens).logits
    assert torch.equal(ref, out)


def _verify(capsys, *args: str) -> dict:
    """`orz convert verify ARGS`'s JSON report (its last line), after a clean exit (its `main`, in
    this process: its ranks fork from the forkserver this module's other worlds already started)."""
    capsys.readouterr()
    code = main(["verify", *args])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return json.loads(out.out.strip().splitlines()[-1])


def test_cli_verify_reports_logit_difference(llama, capsys):
    report = _verify(capsys, "--hf", str(llama), "--tp", "2", "--pp", "1")
    assert report["tp"] == 2 and report["max_abs_logit_diff"] < 1e-4


def _bad(tmp_path, llama, edit):
    bad = tmp_path / "bad"
    shutil.copytree(llama, bad)
    edit(bad)
    return bad


def _set(field, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        if value is None:
            cfg.pop(field)
        else:
            cfg[field] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


@pytest.mark.parametrize(
    "edit,tp,pp,message",
    [
        (lambda d: (d / "config.json").unlink(), 1, 1, r"config.json: missing"),
        (lambda d: (d / "config.json").write_text("{not json"), 1, 1, r"config.json: not valid JSON"),
        (_set("architectures", ["MistralForCausalLM"]), 1, 1, r"config.json: field 'architectures'.*not supported"),
        (_set("hidden_size", None), 1, 1, r"config.json: missing field 'hidden_size'"),
        (_set("num_attention_heads", "four"), 1, 1, r"field 'num_attention_heads' must be a number"),
        # YaRN scales attention as well as RoPE frequencies: refused, not approximated
        (_set("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), 1, 1,
         r"config.json: field 'rope_parameters.rope_type'='yarn' is not supported"),
        (lambda d: (_set("rope_parameters", None)(d), _set("rope_scaling", {"type": "dynamic", "factor": 2.0})(d)), 1, 1,
         r"config.json: field 'rope_scaling.rope_type'='dynamic' is not supported"),
        (_set("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}), 1, 1,
         r"config.json: field 'rope_parameters': missing field 'high_freq_factor'"),
        (_set("use_sliding_window", True), 1, 1, r"config.json: field 'use_sliding_window'=true is not supported"),
        (_set("layer_types", ["sliding_attention", "full_attention"] * 2), 1, 1,
         r"config.json: field 'layer_types' has \['sliding_attention'\]"),
        (_set("attention_sink_size", 4), 1, 1, r"config.json: field 'attention_sink_size'=4: attention sinks"),
        (lambda d: (d / "model.safetensors").unlink(), 1, 1, r"no model.safetensors"),
        (lambda d: None, 3, 1, r"tp=3 does not divide num_attention_heads=4"),
        (lambda d: None, 1, 3, r"pp=3 does not divide num_hidden_layers=4"),
    ],
)
def test_bad_input_names_file_and_field(tmp_path, llama, edit, tp, pp, message, capsys):
    bad = _bad(tmp_path, llama, edit)
    code = main(["hf2mcore", "--hf", str(bad), "--out", str(tmp_path / "out"), "--tp", str(tp), "--pp", str(pp)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_missing_tensor_is_named(tmp_path, llama):
    tensors = _all_tensors(llama)
    tensors.pop("model.layers.2.mlp.up_proj.weight")
    save_hf(tmp_path / "partial", tensors.items(), json.loads((llama / "config.json").read_text()))
    with pytest.raises(ModelConfigError, match=r"partial: tensor 'model.layers.2.mlp.up_proj.weight' is missing"):
        hf2mcore(str(tmp_path / "partial"), str(tmp_path / "out"), tp=1, pp=1)
    assert not (tmp_path / "out").exists()


def test_a_trainer_checkpoint_exports_with_the_files_its_run_kept_and_without_them_is_refused(tmp_path, llama,
                                                                                           capsys):
    """A trainer checkpoint's role (<run>/checkpoints/iter_N/actor) finds the tokenizer and other
    files its run kept (run/hf_files, named by trainer_state.json); one written before there were
    such files is refused before anything is written, asking for --like."""
    from orz.models.checkpoint import keep_hf_files, kept_hf_files

    run = tmp_path / "run"
    actor = run / "checkpoints/iter_000003/actor"
    hf2mcore(str(llama), str(actor))
    shutil.rmtree(actor / "hf_files")  # a trainer's role holds none of its own
    (actor.parent / "trainer_state.json").write_text(json.dumps({"iteration": 3}))  # as written before 2026-12-07
    assert main(["mcore2hf", "--mcore", str(actor), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{actor}: no tokenizer files kept for this checkpoint" in err and "pass --like" in err
    assert not (tmp_path / "hf").exists()
    keep_hf_files(llama, run)  # what the trainer does at its start, referenced by each checkpoint since
    (actor.parent / "trainer_state.json").write_text(json.dumps({"iteration": 3, "hf_files": "../../hf_files"}))
    assert kept_hf_files(actor) == str(actor.parent / "../../hf_files")
    assert main(["mcore2hf", "--mcore", str(actor), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf/tokenizer_config.json").read_text() == "{}"
    assert _all_tensors(tmp_path / "hf").keys() == _all_tensors(llama).keys()


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelConfigError, match="not a directory"):
        read_arch(tmp_path / "nope")


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[2])


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("moe"), family="qwen3_moe", vocab_size=101, head_dim=32, moe=MOE)


def test_moe_round_trip_pp2_ep2_is_bit_exact(tmp_path, qwen3_moe):
    """Saved by four ranks (PP 2 × EP 2), each stage's experts split over two EP ranks; read back in one."""
    hf2mcore(str(qwen3_moe), str(tmp_path / "mcore"), tp=1, pp=2, ep=2)
    saved = load_tensors_metadata(str(tmp_path / "mcore"))
    # by global layer (3: the second stage's last) and expert, whichever EP rank wrote them; layer 2 is dense
    assert tuple(saved["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"].global_shape) == (4, 2 * 32, 64)
    assert "decoder.layers.2.mlp.experts.experts.linear_fc1.weight" not in saved
    mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "back"), like=str(qwen3_moe))
    original, back = load_file(qwen3_moe / "model.safetensors"), load_file(tmp_path / "back/model.safetensors")
    assert original.keys() == back.keys()
    for key in original:
        assert torch.equal(original[key], back[key]), key


@pytest.mark.parametrize(
    "edit,ep,message",
    [
        (lambda d: None, 3, r"ep=3 does not divide num_experts=4"),
        (_set("shared_expert_intermediate_size", 64), 1,
         r"config.json: field 'shared_expert_intermediate_size'=64: a shared expert is not supported"),
        (_set("moe_intermediate_size", None), 1, r"config.json: missing field 'moe_intermediate_size'"),
        (_set("mlp_only_layers", [7]), 1, r"config.json: field 'mlp_only_layers'=\[7\] must list layer indices"),
        (_set("num_experts_per_tok", 5), 1, r"'num_experts_per_tok'=5.*1 <= top_k <= experts"),
    ],
)
def test_moe_bad_input_names_file_and_field(tmp_path, qwen3_moe, edit, ep, message, capsys):
    bad = _bad(tmp_path, qwen3_moe, edit)
    code = main(["hf2mcore", "--hf", str(bad), "--out", str(tmp_path / "out"), "--ep", str(ep)])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path, llama, capsys):
    code = main(["hf2mcore", "--hf", str(llama), "--out", str(tmp_path / "out"), "--ep", "2"])
    assert code == 2 and "ep=2, etp=1: expert parallelism needs a mixture-of-experts model" in capsys.readouterr().err


def test_cli_verify_at_ep2_builds_the_smallest_world(qwen3_moe, capsys):
    report = _verify(capsys, "--hf", str(qwen3_moe), "--tp", "1", "--ep", "2")
    assert (report["ep"], report["dp"]) == (2, 2) and report["max_abs_logit_diff"] < 1e-4
