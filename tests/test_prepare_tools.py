"""python -m mgpu.data.prepare_images and mgpu.data.check_images at their edges: a prepared set
that survives a failed, stopped or killed prepare over it, a DST that is not a set refused, a
Ctrl-C or SIGTERM that stops either tool in one line (pool workers included), and check_images
on a folder training would refuse (an empty class folder, a single class)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

from mgpu.config.checks import ConfigError
from mgpu.data.check_images import main as check_images
from mgpu.data.config import ImageFolderDataConfig, ImageShardsDataConfig
from mgpu.data.prepare_images import main as prepare

PREPARE = "python -m mgpu.data.prepare_images"
CHECK = "python -m mgpu.data.check_images"


def write_folder(root: Path, classes=("ant", "bee", "cow"), per_class=4, seed=0) -> Path:
    """Class folders of small noisy PNGs (each a JPEG of a few KiB once prepared)."""
    rng = np.random.default_rng(seed)
    for name in classes:
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            pixels = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{k:03d}.png")
    return root


def run_prepare(src: Path, dst: Path, *extra: str) -> None:
    prepare([str(src), str(dst), "--max-side", "1000", "--workers", "1", *extra])


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root`, hidden ones too, with a file's bytes."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def command(module: str, args: list[str], hook: str = "") -> subprocess.CompletedProcess:
    """`python -m module args` in a process group of its own, after the Python in `hook`, with
    Ctrl-C's default action, as a terminal's shell starts it (a suite run in the background
    has SIGINT ignored, which a child inherits and Python then leaves ignored)."""
    sigint = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    script = f"import sys\n{sigint}{hook}\nfrom {module} import main\nmain(sys.argv[1:])\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its Ctrl-C, sent to its whole group, reaches nothing else
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # hung (the parent waiting on its pool): end it all
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{module} hung; it said: {err[-3000:]}")
    # Pool workers gone with it: nothing of its process group is left
    for _ in range(50):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"processes of {module} outlived it")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def signal_at(owner: str, method: str, call: int, signum: int, group: bool) -> str:
    """A hook: at the `call`-th call of `owner.method`, `signum` to the whole process group (as a
    terminal sends Ctrl-C: pool workers too) or to the command alone (as `kill PID` does)."""
    module, name = owner.rsplit(".", 1)
    send = "os.killpg(0, sig)" if group else "os.kill(os.getpid(), sig)"
    return f"""
import os, {module}
cls, sig, calls = {module}.{name}, {signum}, []
original = cls.{method}
def stopping(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == {call}:
        {send}
    return original(self, *args, **kwargs)
cls.{method} = stopping
"""


# ---- prepare_images: what DST held survives whatever stops a run ----


@pytest.mark.parametrize(
    "signum, group, before",
    [(signal.SIGINT, True, "a set"), (signal.SIGTERM, False, "a set"), (signal.SIGINT, True, "")],
    ids=["ctrl-c-over-a-set", "sigterm-over-a-set", "ctrl-c-into-a-new-folder"],
)
def test_a_stopped_prepare_says_it_in_one_line_and_leaves_dst_as_it_was(
    tmp_path, signum, group, before
):
    """Stopped at its 10th sample (a few shards written, the workers busy): exit 128 + the
    signal, one line and no traceback from it or its workers, none of them left, and DST as it
    was: the set it held intact, or no folder where there was none."""
    src, dst = write_folder(tmp_path / "src", per_class=20), tmp_path / "dst"
    if before:
        run_prepare(write_folder(tmp_path / "old", per_class=2, seed=1), dst)
    held = tree(dst) if before else None
    args = [str(src), str(dst), "--max-side", "1000", "--shard-mb", "0.01", "--workers", "2"]
    hook = signal_at("mgpu.data.prepare_images.ShardWriter", "add", 10, signum, group)
    proc = command("mgpu.data.prepare_images", [*args, "--overwrite"], hook)
    how = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert proc.stderr == f"{PREPARE}: interrupted ({how}); nothing half-written in {dst}\n"
    assert (tree(dst) if dst.exists() else None) == held


def test_a_failed_prepare_over_a_set_leaves_it_and_a_good_one_replaces_it(tmp_path, capsys):
    """--overwrite with an unreadable image under --bad-files error: exit 1, the set in DST
    untouched (and an empty DST the user made kept); a prepare that succeeds replaces the set
    whole, the old set's extra shards gone."""
    old, dst = write_folder(tmp_path / "old", per_class=6, seed=1), tmp_path / "dst"
    run_prepare(old, dst, "--shard-mb", "0.01")
    held = tree(dst)
    assert len(held) > 3  # several shards: more than the new set will have
    src = write_folder(tmp_path / "src")
    (src / "bee" / "001.png").write_bytes(b"not an image")
    (tmp_path / "empty").mkdir()
    for target in (dst, tmp_path / "empty"):
        with pytest.raises(SystemExit) as stop:
            run_prepare(src, target, "--overwrite")
        assert "1 unreadable image(s), nothing written" in str(stop.value.code)
    assert tree(dst) == held and tree(tmp_path / "empty") == {}
    (src / "bee" / "001.png").unlink()
    run_prepare(src, dst, "--overwrite")
    run_prepare(src, tmp_path / "fresh")
    capsys.readouterr()
    assert tree(dst) == tree(tmp_path / "fresh")
    assert sorted(tree(dst)) == ["index.json", "shard-000000.tar"]


# Kills the command outright once it has moved the new set's second shard into DST: in the
# middle of the swap, DST's old index already gone and the new one not yet in.
KILLED_IN_SWAP = """
import os, signal
replace = os.replace
def replace_then_die(a, b):
    replace(a, b)
    if b == os.path.join(sys.argv[2], "shard-000001.tar"):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
"""


def test_a_run_killed_in_its_swap_is_finished_by_the_next(tmp_path, capsys):
    """The order of the swap lets the next run put the whole new set in place: the same files
    as a run that was never killed, none of the old set's shards left."""
    src, dst = write_folder(tmp_path / "src", per_class=6), tmp_path / "dst"
    run_prepare(write_folder(tmp_path / "old", per_class=12, seed=1), dst, "--shard-mb", "0.01")
    args = [str(src), str(dst), "--max-side", "1000", "--shard-mb", "0.02", "--workers", "1"]
    proc = command("mgpu.data.prepare_images", [*args, "--overwrite"], KILLED_IN_SWAP)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "index.json" not in os.listdir(dst) and (dst / ".prepare.tmp" / "index.json").exists()
    with pytest.raises(ConfigError, match="not a prepared image set"):  # training refuses it
        ImageShardsDataConfig(path=str(dst))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # the next run: the swap finished, then refused
        run_prepare(src, dst, "--shard-mb", "0.02")
    out, err = capsys.readouterr()
    assert f"{PREPARE}: put in place the set that a killed run had written into {dst}" in out
    assert stop.value.code == 2 and "already holds a prepared image set" in err, err
    run_prepare(src, tmp_path / "fresh", "--shard-mb", "0.02")
    assert tree(dst) == tree(tmp_path / "fresh") and len(tree(dst)) > 2


@pytest.mark.parametrize(
    "make, holds",
    [
        (lambda dst: write_folder(dst, classes=("ant", "bee"), per_class=1), "ant/, bee/"),
        (lambda dst: dst.mkdir() or (dst / "notes.txt").write_text("mine"), "notes.txt"),
    ],
    ids=["an-image-folder", "a-folder-of-other-files"],
)
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["", "overwrite"])
def test_a_dst_that_is_neither_empty_nor_a_set_is_refused(tmp_path, capsys, make, holds, overwrite):
    """Exit 2 in one line before any image is read, naming what DST holds, nothing written; a
    folder holding only hidden entries (.DS_Store) counts as empty."""
    src, dst = write_folder(tmp_path / "src"), tmp_path / "dst"
    make(dst)
    held = tree(dst)
    with pytest.raises(SystemExit) as stop:
        run_prepare(src, dst, *overwrite)
    out, err = capsys.readouterr()
    said = (
        f"{PREPARE}: DST={str(dst)!r} is not empty and not a prepared image set (no index.json): "
        f"it holds {holds}; name an empty or new folder, or an existing prepared set with "
        "--overwrite\n"
    )
    assert stop.value.code == 2 and out == "" and err == said, (stop.value.code, out, err)
    assert tree(dst) == held
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".DS_Store").write_bytes(b"")
    run_prepare(src, tmp_path / "hidden")
    assert "index.json" in os.listdir(tmp_path / "hidden")


# ---- check_images ----


def test_check_images_stops_at_ctrl_c_in_one_line(tmp_path):
    """Ctrl-C to the whole process group, as a terminal sends it, with 2 workers decoding: exit
    130 and one line, none of the workers' tracebacks, none of them left."""
    root = write_folder(tmp_path / "imgs", per_class=40)
    hook = signal_at("mgpu.data.progress.Progress", "update", 10, signal.SIGINT, group=True)
    proc = command("mgpu.data.check_images", [str(root), "--workers", "2"], hook)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr == f"{CHECK}: interrupted (Ctrl-C) while checking {root}\n"


def test_check_images_checks_the_other_classes_beside_an_empty_one(tmp_path, capsys):
    """An empty class folder is said as training says it (exit 2), and every image of the other
    classes is still checked: the unreadable one among them named."""
    root = write_folder(tmp_path / "imgs")
    (root / "bee" / "002.png").write_bytes(b"not an image")
    (root / "dog").mkdir()
    with pytest.raises(SystemExit) as stop:
        check_images([str(root), "--workers", "1"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2, (out, err)
    assert f"{root}: 1 of 12 images unreadable" in out, out
    assert f"{root / 'bee' / '002.png'}: not a readable image" in out, out
    assert f"{CHECK}: DIR={str(root)!r}: the class folder {root / 'dog'} holds no images" in err


def test_check_images_refuses_one_class_as_training_does(tmp_path, capsys):
    root = write_folder(tmp_path / "imgs", classes=("ant",))
    with pytest.raises(ConfigError) as training:
        ImageFolderDataConfig(path=str(root))
    with pytest.raises(SystemExit) as stop:
        check_images([str(root), "--workers", "1"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and f"{root}: all 4 images readable" in out, (out, err)
    assert err == f"{CHECK}: {training.value}\n"


def test_a_prepare_into_a_dst_another_run_is_writing_is_refused(tmp_path, capsys):
    """Another run's lock on DST (here this process's own, on the folder as the tool takes it):
    exit 2 in one line, the other run's temporary set and DST left to it (two runs into one
    DST used to remove each other's temporary set and end in tracebacks)."""
    import fcntl

    src, dst = write_folder(tmp_path / "src"), tmp_path / "dst"
    run_prepare(src, dst)
    (dst / ".prepare.tmp").mkdir()  # the other run's set, being written
    held = tree(dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(SystemExit) as stop:
            run_prepare(src, dst, "--overwrite")
    finally:
        os.close(fd)
    said = f"{PREPARE}: DST={str(dst)!r}: another prepare_images is writing it; wait for it\n"
    assert stop.value.code == 2 and capsys.readouterr().err == said
    assert tree(dst) == held
