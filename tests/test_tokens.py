"""A token that starts with '-' works with every documented command form; new tokens never start with one.

``secrets.token_urlsafe`` started with '-' about 1.6% of the time, and ``--token "$(cat STATE_DIR/token)"``
then failed ("argument --token: expected one argument"). The forms: ``--token-file FILE`` on every command that
takes ``--token`` (master, dataset..., dlrover-run, tf-ps-run), ``--token=VALUE``, and ``$STREAMROVER_TOKEN``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamrover.testing.procs import MasterProcess, python_env
from streamrover.tokens import new_token, read_token
from streamrover.trainers.tensorflow.launcher import _parser as tf_ps_parser
from streamrover.trainers.torch.run import parse_args as dlrover_run_args

DASHED = "-Ab3_dashed-token-xyz"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrover.cli", *args], capture_output=True, text=True,
                          env={**python_env(), **(env or {})}, timeout=60)  # fmt: skip


def test_new_tokens_never_look_like_a_flag() -> None:
    tokens = [new_token() for _ in range(20_000)]
    assert not [t for t in tokens if t.startswith("-")]
    assert len(set(tokens)) == len(tokens) and all(len(t) == 48 for t in tokens)


def test_a_dashed_token_file_works_with_every_command_form(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(DASHED + "\n")
    master = MasterProcess(tmp_path / "master", token=DASHED)  # started with --token=VALUE
    master.start()
    try:
        ok = _cli("dataset", "list", "--master", master.address, "--token-file", str(token_file))
        assert ok.returncode == 0, ok.stdout + ok.stderr
        ok = _cli("dataset", "list", "--master", master.address, f"--token={DASHED}")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        ok = _cli("dataset", "list", "--master", master.address, env={"STREAMROVER_TOKEN": DASHED})
        assert ok.returncode == 0, ok.stdout + ok.stderr
        wrong = _cli("dataset", "list", "--master", master.address, "--token-file", str(tmp_path / "missing"))
        assert wrong.returncode == 2 and "cannot read the token file" in wrong.stdout
    finally:
        master.stop()

    # the launchers parse it as the token (they pass it on to the master, the rendezvous and the workers)
    args = dlrover_run_args(["--standalone", "--nproc-per-node", "1", "--shard-service", "127.0.0.1:1",
                             "--token-file", str(token_file), "train.py", "--steps", "3"])  # fmt: skip
    assert args.token == DASHED and args.training_script_args == ["--steps", "3"]
    tf = tf_ps_parser().parse_args(["--ckpt-dir", "/tmp/x", "--token-file", str(token_file), "chief.py"])
    assert read_token(tf.token_file) == DASHED


def test_a_master_takes_its_token_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(DASHED + "\n")
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "streamrover.cli", "master", "--state-dir", str(state), "--port",
                             "0", "--http-port", "-1", "--token-file", str(token_file)],
                            stdout=subprocess.PIPE, text=True, env=python_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.split("listening on ", 1)[1].split(";", 1)[0]
        ok = _cli("dataset", "list", "--master", address, "--token-file", str(token_file))
        assert ok.returncode == 0, ok.stdout + ok.stderr
        refused = _cli("dataset", "list", "--master", address, "--token", "wrong")
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stdout
        assert not (state / "token").exists(), "a master given a token writes none of its own"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_documented_examples_use_a_dashproof_form() -> None:
    """The READMEs and the guide never pass a token as a separate argument after --token (the form that broke)."""
    root = Path(__file__).resolve().parents[1]
    docs = [root / "README.md", *root.glob("examples/*/README.md"), *root.glob("docs/guide/*.md")]
    for doc in docs:
        text = doc.read_text()
        assert '--token "$(' not in text and "--token $(" not in text, f"{doc}: use --token-file or --token="
