"""The README and the user guide (docs/*.md) say only what the code takes: every command's
train.py overrides compose against the real conf/ tree and schemas, every flag of an mgpu
command or a benchmark is one its --help lists, every script named exists, and every
`group.key` in the prose is a field of that group's schemas. A key renamed without the docs
fails here."""

import contextlib
import io
import re
import shlex
import subprocess
import sys
from functools import cache

import pytest
from conftest import ROOT
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

import mgpu.run.config  # noqa: F401  (registers the schemas with Hydra)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = ("model", "data", "optim", "trainer", "dist", "ckpt")
# Keys the docs name as examples of what is refused.
WRONG_ON_PURPOSE = {"optim.lrr"}
MODULES = {
    "mgpu.data.prepare",
    "mgpu.data.prepare_images",
    "mgpu.data.check_images",
    "mgpu.evaluate",
    "mgpu.sample",
    "mgpu.export",
}


def commands(text: str) -> list[str]:
    """The shell commands of a page's unlabelled code blocks (python and yaml blocks are code),
    continuation lines joined, comments dropped."""
    found = []
    for block in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        language, body = block
        if language not in ("", "sh", "bash", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#\s.*$", "", line).strip()
            if line:
                found.append(line)
    return found


def schema_fields(group: str) -> set[str]:
    """Every field of every schema registered for `group` (or the group's one schema)."""
    if group in ("optim", "trainer", "dist", "ckpt"):
        node = ConfigStore.instance().repo["config_schema.yaml"].node
        return set(node[group].keys())
    names = set()
    for entry in ConfigStore.instance().repo[group].values():
        names |= set(entry.node.keys())
    return names


def overrides_problem(overrides: list[str]) -> str | None:
    """Why Hydra refuses these train.py overrides against conf/, or None. A sweep takes its
    first value; hydra.* belongs to Hydra."""
    kept = []
    for item in overrides:
        if item.startswith(("hydra.", "-")) or "=" not in item:
            continue
        key, value = item.split("=", 1)
        if value.startswith(("choice(", "range(")):
            value = value[value.index("(") + 1 :].split(",")[0].rstrip(")")
        kept.append(f"{key}={value.split(',')[0]}")
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            compose(config_name="config", overrides=kept)
    except Exception as err:  # Hydra's and OmegaConf's errors alike
        return f"{kept}: {str(err).splitlines()[0]}"
    return None


@cache
def help_text(program: str) -> str:
    """What `--help` prints for an mgpu module (run here) or a script (run as users do)."""
    if program in MODULES:
        module = __import__(program, fromlist=["main"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            module.main(["--help"])
        return out.getvalue()
    runner = ["bash"] if program.endswith(".sh") else [sys.executable]
    proc = subprocess.run(
        [*runner, str(ROOT / program), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{program} --help: {proc.stderr[-2000:]}"
    return proc.stdout


def command_problems(line: str) -> list[str]:
    """What in one documented command the code does not take. Lines of a block that start with
    no launcher (a log line, a file tree) are not commands."""
    first = [w for w in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)][:1]
    launcher = r"torchrun|python3?|\.venv/bin/python|sbatch|(launch|bench)/\S+\.(sh|sbatch|py)"
    if not first or not re.fullmatch(launcher, first[0]):
        return []
    words = shlex.split(line.replace("<", "_").replace(">", "_"))
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):  # NAME=value before the command
        words.pop(0)
    problems = []
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else ""
    if module and not module.startswith("mgpu.") and words[0] != "torchrun":
        return problems  # python -m pytest, python -m venv
    if module.startswith("mgpu."):
        program, args = module, words[words.index("-m") + 2 :]
    else:
        scripts = [i for i, w in enumerate(words) if w.endswith((".py", ".sh", ".sbatch"))]
        if not scripts:
            return [f"{line!r}: no program found"]
        program, args = words[scripts[0]], words[scripts[0] + 1 :]
        if program.endswith("train.py") or program.startswith("launch/"):
            if program.startswith("launch/") and not (ROOT / program).is_file():
                problems.append(f"{line!r}: {program} does not exist")
            why = overrides_problem(args)
            return problems + ([f"{line!r}: {why}"] if why else [])
        if not (ROOT / program).is_file():
            return [f"{line!r}: {program} does not exist"]
    listed = help_text(program)
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        if not re.search(rf"{re.escape(flag)}\b", listed):
            problems.append(f"{line!r}: {program} takes no {flag}")
    if program == "mgpu.evaluate":
        why = overrides_problem([a for a in args if "=" in a and not a.startswith("-")])
        problems += [f"{line!r}: {why}"] if why else []
    return problems


def key_problems(text: str) -> list[str]:
    """`group.key` names in the prose that no schema of the group has."""
    found = re.findall(rf"`\+?((?:{'|'.join(GROUPS)})\.[A-Za-z0-9_]+)", text)
    return sorted(
        {
            key
            for key in found
            if key not in WRONG_ON_PURPOSE
            and key.split(".")[1] not in schema_fields(key.split(".")[0])
        }
    )


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_is_one_the_code_takes(page):
    found = commands(page.read_text())
    problems = [p for line in found for p in command_problems(line)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_key_is_a_schema_field(page):
    assert not key_problems(page.read_text())


def test_the_checks_find_a_renamed_key_flag_script_and_choice():
    """The checks above can fail: each kind of stale documentation, made up here."""
    stale = "`trainer.max_step` and `data.batch_size`"
    assert key_problems(stale) == ["trainer.max_step"]
    assert command_problems("torchrun --nproc_per_node=2 train.py optim.lrate=1e-3")
    assert command_problems("torchrun --nproc_per_node=2 train.py model=gpt2")
    assert not command_problems("torchrun --nproc_per_node=2 train.py model=gpt2_small optim.lr=1")
    assert command_problems("python -m mgpu.data.prepare in.txt out.bin --train-bpe-size 8")
    assert command_problems("python bench/no_such_bench.py --quick")
    assert command_problems("NPROC=2 launch/no_such_launcher.sh")


def test_the_readme_stays_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    # the several-GPU figures are one section, delimited, so that they can be replaced whole
    begin, end = text.index("<!-- scaling: begin"), text.index("<!-- scaling: end -->")
    assert text[begin:end].count("\n## ") == 1 and "## Scaling" in text[begin:end]
    links = re.findall(r"\]\(((?:docs|bench)/[^)#]*)", text)
    assert links and all((ROOT / link).exists() for link in links), links
