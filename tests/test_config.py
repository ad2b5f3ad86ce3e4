"""Config schema and validation: the real conf/ tree composed with Hydra, and bad input rejected
with one clear line before any process group or run directory exists."""

import math
from pathlib import Path

import pytest
import torch
from conftest import ROOT, one_line_under_torchrun, run_train, said_by_train_py
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mgpu.config.checks import ConfigError
from mgpu.data.config import NgramDataConfig
from mgpu.data.prepare import main as prepare_main
from mgpu.models.config import GPTModelConfig
from mgpu.run.build import unused_vocabulary
from mgpu.run.config import resolved_yaml, to_config


def compose_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_is_the_small_gpt_on_ngram_tokens():
    cfg = to_config(compose_config())
    assert isinstance(cfg.model, GPTModelConfig) and isinstance(cfg.data, NgramDataConfig)
    assert cfg.dist.engine.value == "mgpu" and cfg.dist.backend.value == "auto"
    assert cfg.trainer.precision.value == "auto"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    """A byte-level token file with its metadata, as mgpu.data.prepare writes them."""
    out = tmp_path_factory.mktemp("tokens")
    (out / "in.txt").write_text("some text\n" * 27_000)  # enough for GPT-2's 1024 x 257 windows
    prepare_main([str(out / "in.txt"), str(out / "train.bin")])
    return str(out / "train.bin")


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=gpt2_small", "data=tokens", "data.path={tokens}", "data.vocab_size=50304"],
        ["experiment=gpt2_small", "data.path={tokens}"],
        ["experiment=resnet50"],
        ["model=resnet_tiny", "data=images"],
        ["model=mlp", "data=images", "optim=sgd"],
        ["model=custom", "model._target_=torch.nn.Linear", "+model.kwargs.in_features=4"],
    ],
)
def test_builtin_choices_compose_and_validate(overrides, token_file):
    to_config(compose_config(*(item.format(tokens=token_file) for item in overrides)))


def test_the_saved_config_names_the_datas_files_from_anywhere(token_file):
    """config.yaml and the checkpoints hold a relative data.path (and data.tokenizer) made
    absolute (mgpu.evaluate run from another directory finds the file); the ranks compare the
    config as given (nodes may start in other directories of one layout); a path that names
    nothing is left alone."""
    folder = Path(token_file).parent
    cfg = compose_config("data=tokens", "data.path=train.bin")
    assert OmegaConf.create(resolved_yaml(cfg)).data.path == "train.bin"
    assert OmegaConf.create(resolved_yaml(cfg, files_from=folder)).data.path == token_file
    nowhere = compose_config("data=tokens", "data.path=nowhere.bin")
    assert OmegaConf.create(resolved_yaml(nowhere, files_from=folder)).data.path == "nowhere.bin"
    absolute = compose_config("data=tokens", f"data.path={token_file}")
    assert OmegaConf.create(resolved_yaml(absolute, files_from=ROOT)).data.path == token_file
    # the rest of the config is what the ranks compare
    rest = OmegaConf.create(resolved_yaml(cfg, files_from=folder))
    rest.data.path = "train.bin"
    assert rest == OmegaConf.create(resolved_yaml(cfg))
    # a tokenizer.json named from the start directory too; bytes, none and auto name no file,
    # even where the directory holds one of that name
    (folder / "t.json").write_text("{}")
    (folder / "bytes").write_text("")
    for tokenizer, saved in (("t.json", str(folder / "t.json")), ("bytes", "bytes")):
        named = compose_config("data=tokens", "data.path=train.bin", f"data.tokenizer={tokenizer}")
        assert OmegaConf.create(resolved_yaml(named, files_from=folder)).data.tokenizer == saved


def test_gpt2_small_is_the_124m_shape():
    # model.vocab_size=auto: GPT-2's 50257 tokens, rounded up to a multiple of 64
    m = to_config(compose_config("model=gpt2_small", "data.vocab_size=50257")).model
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, m.vocab_size) == (12, 768, 12, 1024, 50304)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=-1", "optim.lr"),
        ("data.batch_size=0", "data.batch_size"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.loss_scale_init=0", "trainer.loss_scale_init"),
        ("+optim.lrr=1", "optim.lrr"),
        ("data.seq_len=128", "data.seq_len"),  # longer than the tiny GPT's block_size of 64
        ("model.attention=fast", "model.attention"),
        ("data=images data.num_classes=1", "data.num_classes"),  # nothing to learn
    ],
)
def test_nonsensical_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_config(compose_config(*override.split()))


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["model=resnet_tiny"], "data='ngram': an image model needs image data"),
        (["model=mlp", "data=tokens", "data.path={tokens}"], "data='tokens': an image model"),
        (["data=images"], "data='images': a GPT model needs token data"),
        (["data=image_folder", "data.path={folder}"], "data='image_folder': a GPT model"),
    ],
)
def test_a_model_on_the_wrong_kind_of_data_names_the_data_chosen(tmp_path, overrides, said):
    from PIL import Image

    tokens = tmp_path / "t.bin"
    prepare_main([str(ROOT / "README.md"), str(tokens)])
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "0.png")
    overrides = [o.format(tokens=tokens, folder=tmp_path) for o in overrides]
    with pytest.raises(ConfigError) as caught:
        to_config(compose_config(*overrides))
    assert said in str(caught.value), caught.value
    assert "data=image_folder" in str(caught.value) or "data=tokens" in str(caught.value)


def test_a_classifiers_input_follows_the_datas_images_and_a_number_must_match(tmp_path):
    """model.in_channels (ResNet) and model.in_features (MLP) are auto: the data's channels,
    and its values per image; image folders are RGB. A number that differs is one line."""
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "0.png")
    folder = ["data=image_folder", f"data.path={tmp_path}", "data.image_size=8"]
    gray = to_config(compose_config("model=resnet_tiny", "data=images", "data.channels=1"))
    assert gray.model.in_channels == 1 and gray.model.model_kwargs()["in_channels"] == 1
    small = to_config(compose_config("model=mlp", "data=images", "data.image_size=16"))
    assert small.model.in_features == 3 * 16 * 16
    assert to_config(compose_config("model=mlp", *folder)).model.in_features == 3 * 8 * 8
    with pytest.raises(ConfigError, match=r"model\.in_channels=1: must equal the data's chan"):
        to_config(compose_config("model=resnet_tiny", "model.in_channels=1", *folder))
    with pytest.raises(ConfigError, match=r"in_features=5: .* \(3072\); set model.in_features=a"):
        to_config(compose_config("model=mlp", "model.in_features=5", "data=images"))


BAD_INPUT = [
    ("trainer.max_steps=abc", ["trainer.max_steps", "abc"]),
    ("optim.lrr=1", ["optim.lrr"]),
    ("+optim.lrr=1", ["optim.lrr", "1"]),
    ("optim.lr=-1", ["optim.lr", "-1"]),
    ("data.batch_size=0", ["data.batch_size", "0"]),
    ("trainer.precision=bf17", ["trainer.precision", "bf17"]),
    ("data=tokens", ["data.path", "required"]),  # a missing required value
]


@pytest.mark.parametrize("override, expected", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_key_and_value(tmp_path, override, expected):
    line = said_by_train_py([override], tmp_path)
    assert "\n" not in line
    for word in expected:
        assert word in line, line


def test_bad_input_exits_before_any_run_directory(tmp_path):
    override, expected = BAD_INPUT[0]
    run_dir = tmp_path / "run"
    proc = run_train([override, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == said_by_train_py([override], tmp_path), proc.stderr
    for word in expected:
        assert word in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_ddp_static_graph_with_accumulation_is_refused_before_the_run(tmp_path):
    """torch's reducer asserts on the first micro-step that skips the reduction under a static
    graph; mgpu stops the pair in one line naming both keys. Without accumulation it runs."""
    pair = ["dist.engine=torch_ddp", "dist.ddp_static_graph=true"]
    to_config(compose_config(*pair))  # one micro-step: fine
    with pytest.raises(ConfigError, match=r"dist\.ddp_static_graph.*trainer\.grad_accum_steps=2"):
        to_config(compose_config(*pair, "trainer.grad_accum_steps=2"))
    mgpu_engine = ["dist.engine=mgpu", "dist.ddp_static_graph=true"]  # a torch DDP key only
    to_config(compose_config(*mgpu_engine, "trainer.grad_accum_steps=2"))
    # train.py's first step says it, before the ranks meet: that such a line is said once under
    # torchrun, exit 2, before any run directory, is the launch of a newcomer's mistake below
    line = said_by_train_py([*pair, "trainer.grad_accum_steps=2"], tmp_path)
    assert "dist.ddp_static_graph" in line and "set dist.ddp_static_graph=false" in line, line


@pytest.fixture(scope="module")
def bad_token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("odd") / "odd.bin"
    path.write_bytes(b"\0" * 2001)
    return str(path)


NEWCOMER_MISTAKES = [
    (["optim.lrr=1e-3"], ["optim.lrr='1e-3'", "did you mean optim.lr=1e-3"]),
    (["optim.lr=fast"], ["optim.lr='fast'", "Float", "e.g. optim.lr=0.001"]),
    (["model=gpt2"], ["model='gpt2'", "did you mean model=", "model=gpt2_small", "'gpt_tiny'"]),
    (["optim.lr=-1"], ["optim.lr=-1.0", "must be > 0"]),
    (["data.eval_samples=0"], ["data.eval_samples=0", "must be > 0, e.g. data.eval_samples=1024"]),
    (
        ["model=custom", "model._target_=torch.nn.Linear", "model.kwargs.in_features=4"],
        ["model.kwargs.in_features='4'", "added with a '+': +model.kwargs.in_features=4"],
    ),
    (["data=tokens", "data.path=nope.bin"], ["data.path='nope.bin'", "mgpu.data.prepare"]),
    (  # the class list given (as a saved config has it): the folder is still checked to train
        ["model=resnet_tiny", "data=image_folder", "data.path=nope", "data.classes=[a,b]"],
        ["data.path='nope': does not exist", "one subfolder of images"],
    ),
    (
        ["data._target_=mypkg.data.MyDataset"],
        ["data._target_='mypkg.data.MyDataset'", "No module named 'mypkg'"],
    ),
    (["ckpt.resume={empty}"], ["ckpt.resume=", "no checkpoints/"]),
    (  # every value given: nothing else reads the file before the run would
        ["data=tokens", "data.path=nope.bin", "data.tokenizer=bytes", "data.vocab_size=256"],
        ["data.path='nope.bin'", "no such file", "mgpu.data.prepare"],
    ),
    (
        ["data=tokens", "data.path={odd}", "data.tokenizer=bytes"],
        ["odd.bin", "2001 bytes, not a multiple of 2"],
    ),
    (  # the folder the token file is in, whether anything else reads it first or not
        ["data=tokens", "data.path={empty}"],
        ["empty': is a folder; name the token file in it, e.g. data.path=", "empty/train.bin"],
    ),
    (
        ["data=tokens", "data.path={empty}", "data.tokenizer=bytes", "data.vocab_size=256"],
        ["empty': is a folder; name the token file in it"],
    ),
    (["data=tokens", "data.path=null"], ["data.path='null': field 'data.path' is not Optional"]),
]


@pytest.mark.parametrize("overrides, expected", NEWCOMER_MISTAKES)
def test_newcomer_mistakes_are_each_one_clear_line(tmp_path, bad_token_file, overrides, expected):
    (tmp_path / "empty").mkdir()
    args = [arg.format(empty=tmp_path / "empty", odd=bad_token_file) for arg in overrides]
    line = said_by_train_py(args, tmp_path)
    for word in expected:
        assert word in line, line
    assert "schema" not in line and "???" not in line  # no required setting's placeholder


# A launch under torchrun of a mistake in the data (a file the check opens): the line above,
# once, exit 2, no run directory. The launch of a mistake in a key (NEWCOMER_MISTAKES[0]) is
# tests/test_one_line.py's test_torchruns_report_names_the_config_error_as_the_root_cause.
def test_newcomer_mistakes_are_one_line_once_exit_2_before_any_run_directory(
    tmp_path, bad_token_file
):
    overrides, expected = NEWCOMER_MISTAKES[-1]
    run_dir = tmp_path / "run"
    args = [arg.format(odd=bad_token_file) for arg in overrides]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2)
    line = one_line_under_torchrun(proc, run_dir)
    for word in expected:
        assert word in line, line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda path: path.write_bytes(b""), "is empty, too few"),
        (lambda path: path.write_bytes(b"\0" * 100), "has 50 tokens, too few"),
    ],
)
def test_a_token_file_too_short_is_a_config_error(tmp_path, make, needle):
    make(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=needle):
        to_config(
            compose_config("data=tokens", f"data.path={tmp_path / 't.bin'}", "data.tokenizer=bytes")
        )


def test_gpt2_small_on_byte_tokens_has_a_byte_vocabulary():
    # model.vocab_size=auto follows the data: no 50,048 rows the data never uses
    cfg = to_config(compose_config("model=gpt2_small", "data.vocab_size=256"))
    assert cfg.model.vocab_size == 256
    assert unused_vocabulary(cfg) is None
    cfg = to_config(
        compose_config("model=gpt2_small", "model.vocab_size=50304", "data.vocab_size=256")
    )
    assert "50048 embedding rows" in unused_vocabulary(cfg)  # said once at the start of the run


def test_ngram_entropy_is_what_the_readme_states():
    readme = (ROOT / "README.md").read_text()
    assert f"{math.log(4):.3f}" in readme


def test_a_gpt_on_a_users_dataset_follows_its_vocab_size_kwarg_or_is_told_to_set_one():
    custom = ["data=custom", "data._target_=tests.faults.FaultyTokens"]
    cfg = to_config(compose_config(*custom, "+data.kwargs.vocab_size=300"))
    assert cfg.model.vocab_size == 320  # rounded up to a multiple of 64
    with pytest.raises(ConfigError, match=r"model\.vocab_size='auto'.*FaultyTokens"):
        to_config(compose_config(*custom))
    assert to_config(compose_config(*custom, "model.vocab_size=256")).model.vocab_size == 256


def test_a_bad_swept_value_stops_its_sweep_in_one_line(tmp_path):
    """--multirun: every point's swept values are checked before the first one runs
    (mgpu.run.cli.check_command_line; Hydra checks only the base config at a sweep's start)."""
    out = run_train(
        ["--multirun", "optim.lr=-1,0.1", "trainer.max_steps=2"], cwd=tmp_path, nproc=None
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-2000:]
    assert text.count("mgpu: config error: optim.lr=-1.0") == 1 and "Traceback" not in text
    assert "#0 :" not in text and not (tmp_path / "multirun").exists()  # no job started


def test_help_lists_each_groups_choices_then_the_config_the_overrides_compose(tmp_path):
    """`train.py --help`: mgpu's usage, every config group with its YAML files as its choices
    (not the schemas stored under the same groups in Hydra's ConfigStore), then the composed
    config; exit 0 and nothing written."""
    proc = run_train(["model=gpt2_small", "--help"], cwd=tmp_path, nproc=None, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "torchrun --nproc_per_node=N train.py" in text and "--hydra-help" in text
    listed = text.split("== Config groups", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    groups = dict(line.split(": ", 1) for line in listed)
    on_disk = sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir())
    assert sorted(groups) == [d.name for d in on_disk]
    for group_dir in on_disk:
        assert groups[group_dir.name] == ", ".join(sorted(p.stem for p in group_dir.glob("*.yaml")))
    config = text.split("== Config (", 1)[1]
    assert "n_embd: 768" in config and "block_size: 1024" in config  # gpt2_small's
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for machines without CUDA")
@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_an_attention_kernel_without_a_cpu_implementation_is_one_line_on_a_cpu(tmp_path, kernel):
    line = said_by_train_py([f"model.attention={kernel}"], tmp_path)
    assert f"model.attention='{kernel}'" in line and "CUDA GPUs only" in line, line
    assert "flash or math" in line
