"""`vpscluster plan` as a user runs it: model sources, --json shape, one-line errors."""

from __future__ import annotations

import json

import pytest

from vpscluster.errors import UserError
from vpscluster.plan.shapes import load_model

CONTRACT_KEYS = ("strategy", "step_seconds", "compute_seconds", "comm_seconds", "tokens_per_s",
                 "compute_utilization", "memory_bytes_per_node", "fits", "time_to_train_seconds",
                 "egress_bytes_per_node_per_day", "reason", "assumptions")


@pytest.fixture
def plan(cli, tmp_path):
    def run(*args):
        # A private HOME: no calibration or probe cached by earlier runs changes the result.
        return cli("plan", *args, timeout=120, env={"HOME": str(tmp_path)})
    return run


def test_gpt2_config_json_gives_gpt2_parameter_count(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
           "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path / "config.json"))
    assert model.num_params() == 124_439_808  # GPT-2 small, tied head
    assert not model.shape.gated_mlp and model.shape.d_ff == 3072
    assert load_model(str(tmp_path)).num_params() == 124_439_808  # a folder holding config.json


def test_llama_config_json_is_gated_and_untied(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
           "hidden_act": "silu", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path / "config.json"))
    assert model.shape.gated_mlp and model.untied_head
    # Llama-2-7B has 6,738,415,616 parameters; vpscluster's layout adds biases and learned positions.
    assert model.num_params() == pytest.approx(6_738_415_616, rel=0.01)


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"hidden_size": 64}', "missing"),
    ('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 5, "vocab_size": 10, "n_positions": 8}',
     "not divisible"),
])
def test_bad_config_json_is_one_clear_error(tmp_path, content, needle):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(UserError, match=needle):
        load_model(str(tmp_path / "config.json"))


def test_json_output_shape(plan):
    r = plan("--model", "small", "--nodes", "4", "--bandwidth", "100mbit", "--rtt-ms", "1", "--flops", "20",
             "--tokens", "100M", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    for key in CONTRACT_KEYS:
        assert key in doc, key
    assert doc["strategy"] in ("ddp", "diloco") and doc["tokens"] == 1e8
    assert len(doc["nodes"]) == 4 and doc["world_size"] == 4
    assert {"order", "weakest_link_mbit"} <= set(doc["ring"])
    assert doc["guidance"]["ddp_link_mbit_for_90pct_utilization"] > 100
    assert doc["candidates"] and all(c["time_to_train_seconds"] > 0 for c in doc["candidates"])
    assert doc["step_seconds"] == pytest.approx(doc["compute_seconds"] + doc["comm_seconds"])


def test_explicit_strategy_is_planned_and_auto_named(plan):
    r = plan("--model", "small", "--nodes", "2", "--bandwidth", "20mbit", "--flops", "20", "--strategy", "ddp",
             "--compress", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["strategy"] == "ddp" and doc["settings"]["compress"] == "bf16"
    assert doc["reason"].startswith("as asked") and "diloco" in doc["reason"]


def test_human_output_names_the_choice_and_assumptions(plan):
    r = plan("--model", "tiny", "--nodes", "2", "--bandwidth", "1gbit", "--flops", "20")
    assert r.returncode == 0, r.stderr
    assert "Plan" in r.stdout and "Assumed" in r.stdout and "Hardware guidance" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("--model", "gpt5"), "not a preset"),
    (("--model", "/nonexistent/config.json"), "cannot read"),
    (("--model", "small", "--probe", "/nonexistent/probe.json"), "--probe"),
    (("--model", "small", "--bandwidth", "fast"), "not a rate"),
    (("--model", "small", "--cluster", "/nonexistent/cluster.yaml"), "no such cluster file"),
])
def test_bad_input_is_one_line_without_traceback(plan, args, needle):
    r = plan(*args, "--nodes", "2") if "--cluster" not in args else plan(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert r.stdout == ""
