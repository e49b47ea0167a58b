import subprocess
import sys

import pytest

from jaxtron.config.loading import (
    config_from_dict,
    config_to_dict,
    dump_config,
    field_reference,
    load_config,
)
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError

from conftest import make_config, run_in_process


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 3\ntrain:\n  steps: 7\n")
    c = load_config(path, ["train.steps=50", "model.d_model=96", "optim.lr=1e-3",
                           "model.num_kv_heads=null", "model.dtype=bfloat16"])
    assert c.model.num_layers == 3 and c.train.steps == 50 and c.model.d_model == 96
    assert c.optim.lr == 1e-3 and c.model.kv_heads == c.model.num_heads
    assert c.model.dtype == "bfloat16"
    assert c.model.resolved_head_dim == 96 // 4


@pytest.mark.parametrize("name, billions", [
    ("llama3.1-8b", 8.03),   # Meta's model card: 8.03B
    ("qwen3-8b", 8.19),      # Qwen3 technical report: 8.2B
    ("deepseek-v3", 671.71),  # 671B + the multi-token-prediction module (one dense block here)
])
def test_published_shapes_have_the_published_parameter_counts(name, billions):
    import math

    import jax
    from flax import nnx

    from jaxtron.models.transformer import Transformer

    c = load_config(f"configs/{name}.yaml")
    model = nnx.eval_shape(lambda: Transformer(c.model, rngs=nnx.Rngs(0), moe=c.moe))
    count = sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count / 1e9 == pytest.approx(billions, abs=0.01)


def test_dump_round_trips(tmp_path):
    c = make_config()
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(c))
    assert load_config(path) == c


def test_shipped_configs_load():
    import pathlib
    for path in sorted(pathlib.Path("configs").glob("*.yaml")):
        c = load_config(path)
        assert c.model.num_layers > 0, path
    big = load_config("configs/llama3-70b.yaml")
    assert (big.model.num_layers, big.model.d_model, big.model.kv_heads) == (80, 8192, 8)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.num_layer=3"], "unknown config key model.num_layer. Did you mean model.num_layers?"),
    (["modle.d_model=3"], "unknown config key modle"),
    (["train.steps=ten"], "train.steps='ten' has type str; it must be int"),
    (["model.d_model=130"], "model.d_model=130 is not divisible by model.num_heads=4"),
    (["model.num_kv_heads=3"], "must be a multiple of model.num_kv_heads=3"),
    (["optim.grad_accum=3"], "train.batch_size=16 must be divisible by optim.grad_accum=3"),
    (["model.remat=sometimes"], "model.remat='sometimes' is not supported; choose one of none"),
    (["model.dtype=float8"], "model.dtype='float8' is not supported"),
    (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len=2048"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "mesh.stage may be -1 (= the rest)"),
    (["mesh.stage=2", "pipeline.virtual_stages=2", "pipeline.schedule=1f1b"],
     "needs pipeline.schedule=interleaved"),
    (["mesh.stage=2", "pipeline.schedule=zbv", "pipeline.virtual_stages=3"],
     "set pipeline.virtual_stages=2 (got 3)"),
    (["mesh.stage=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2",
      "pipeline.microbatches=3"], "to be a multiple of mesh.stage (2)"),
    (["mesh.stage=4", "model.num_layers=3"], "cannot be split over mesh.stage x"),
    (["mesh.stage=2", "pipeline.layers_per_stage=[1,2]"], "summing to model.num_layers=2"),
    (["pipeline.microbatches=4"], "need mesh.stage > 1"),
    (["train.steps"], "must look like section.key=value"),
    (["model.type=gpt2", "model.num_kv_heads=2"], "model.type=gpt2 uses multi-head attention"),
    (["model.rope_scaling=llama3", "model.rope_high_freq_factor=0.5"],
     "model.rope_high_freq_factor=0.5 must exceed model.rope_low_freq_factor=1.0"),
    (["model.rope_scaling=yarn", "model.rope_factor=0"], "model.rope_factor=0.0 and"),
    (["optim.schedule=wsd", "optim.decay_fraction=1.5"], "optim.decay_fraction=1.5 must lie"),
    (["optim.warmup_steps=20", "optim.decay_steps=10"], "optim.decay_steps=10 must exceed"),
])
def test_bad_fields_name_the_field_and_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, overrides)
    assert fragment in str(err.value)


def test_cli_reports_errors_without_traceback():
    result = subprocess.run([sys.executable, "-m", "jaxtron.train", "--config",
                             "configs/tiny.yaml", "model.num_layer=3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Did you mean model.num_layers?" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_print_config():
    result = run_in_process("jaxtron.train", "--config", "configs/tiny.yaml", "--print-config",
                            "train.steps=3")
    assert result.returncode == 0, result.stderr
    assert "steps: 3" in result.stdout


def test_help_lists_every_config_field_with_type_default_and_meaning():
    result = run_in_process("jaxtron.train", "--help")
    assert result.returncode == 0
    rows = field_reference()
    keys = {key for key, *_ in rows}
    assert {"model.d_model", "mesh.tensor", "distributed.process_id", "train.profile_steps",
            "checkpoint.every"} <= keys
    leaves = {f"{section}.{name}" for section, fields in config_to_dict(
        Config()).items() for name in fields}
    assert keys == leaves  # one line for every field of the dataclass tree, nothing else
    for key, type_name, default, meaning in rows:
        line = next(x for x in result.stdout.splitlines() if x.split()[:1] == [key])
        assert type_name in line and default in line and meaning.split()[0] in line, line
        assert meaning, f"{key} has no help text"
