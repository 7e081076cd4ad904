"""Redaction: by name, by shape, by value; anonymising; scrubbing executed notebooks."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import nbformat
import pytest

from helpers import redact

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "audit"))
from secret_env import NOT_COLLECTED, SECRET_ENV, SECRETS, leaks  # noqa: E402


@pytest.fixture
def secret_environment(monkeypatch):
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    return SECRET_ENV


def test_the_fixture_has_enough_secrets():
    assert len(SECRET_ENV) >= 20 and len(SECRETS) >= 20


def test_redact_env_hides_names_and_hidden_values():
    harmless = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false",
                "MASTER_PORT": "29500"}
    cleaned = redact.redact_env({**SECRET_ENV, **harmless})
    assert leaks(json.dumps(cleaned)) == []
    assert {name: cleaned[name] for name in harmless} == harmless
    assert cleaned["HF_TOKEN"] == cleaned["DB_PASSWORD"] == redact.REDACTED
    assert cleaned["MASTER_ADDR"] == "https://trainer:<redacted>@10.1.2.3"
    assert cleaned["TORCH_HOME"] == "/data/<redacted>/torch"


def test_redact_text_uses_the_environment_values(secret_environment):
    log = "\n".join(f"step 3 {name} -> {value} (copied)" for name, value in SECRET_ENV.items())
    log += "\ncache at /mnt/" + SECRET_ENV["WANDB_API_KEY"] + "/x"  # no shape, only the env knows it
    assert leaks(redact.redact_text(log)) == []


def test_extra_values_are_redacted():
    assert redact.redact_text("user passphrase is swordfish42", ["swordfish42"]) == \
        "user passphrase is <redacted>"


@pytest.mark.parametrize("text", [
    "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz123",
    "Authorization: Bearer abcdefghijklmnopqrstuv",
    "postgres://admin:hunter2hunter2@db:5432/x",
    'config = {"api_key": "abc123xyz987"}',
    "python train.py --hf-token abcdef123456 --lr 3e-4",
    "python train.py --password abcdef123456",
    "python train.py --token abcdef123456",
    "python train.py --wandb_api_key=abcdef123456",
    "AccountKey=Zm9vYmFyYmF6==;EndpointSuffix=core.windows.net",
    "export MY_SECRET=plain-looking-value",
    'password: "tr0ub4dor&3"',
])
def test_shapes_are_redacted(text):
    cleaned = redact.redact_text(text)
    assert redact.REDACTED in cleaned
    secret = {"HF_TOKEN": "hf_abc", "Bearer": "abcdefghijkl", "postgres": "hunter2", "config": "abc123",
              "python": "abcdef123456", "AccountKey": "Zm9vYmFy", "export": "plain-looking",
              "password": "tr0ub4dor"}
    assert not any(value in cleaned for key, value in secret.items() if text.startswith(key))


@pytest.mark.parametrize("text", [
    "x = sorted(items, key=len)",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN=1",
    "TOKENIZERS_PARALLELISM=false",
    "from sklearn import x; sk-learn is fine",
    "see https://huggingface.co/docs/accelerate for more",
    '{"max_session_len": 100}',
    "tokenizer = AutoTokenizer.from_pretrained(name)",
    "hf_hub_download(repo_id)",
    "python train.py --max-tokens 512 --tokenizer gpt2 --tokens_per_batch 4096",
    "python train.py --author Jane --sessions 3 --session-name run1 --key-column text --eos_token_id 2",
    "python train.py --use_auth_token True --sort_key loss --primary_key id --max_session_len 100",
    "Rank 3 raised KeyError: 'labels' at train.py:31",  # the doctor's summary: the key is the clue
    "TokenizerException: 'unknown_token'",
])
def test_look_alikes_are_left_alone(text):
    assert redact.redact_text(text) == text


@pytest.mark.parametrize("argv, secret", [
    (["sh", "-c", "sleep 30", "job", "--api-key", "p&ss!word"], "p&ss"),  # quoted by a shell, still one word
    (["run", "--password", "a b c"], "a b"),
    (["env", "DB_PASSWORD=p&ss;word", "python", "x.py"], "p&ss"),
    (["env", "HF_TOKEN=abc def ghi", "python"], "def"),
    (["sshpass", "-p", "hunter2secret", "ssh", "host"], "hunter2"),
    (["mysql", "-phunter2secret", "db"], "hunter2"),
    (["curl", "-u", "admin:pass1234", "https://x"], "pass1234"),
    (["wandb", "login", "0123456789abcdef0123456789abcdef01234567"], "0123456789abcdef"),
    (["git", "clone", "https://ghp123tokenvalue@github.com/x/y"], "ghp123"),
])
def test_a_command_lines_secrets_are_redacted_word_by_word(argv, secret):
    cleaned = redact.redact_argv(argv)
    assert len(cleaned) == len(argv) and redact.REDACTED in " ".join(cleaned)
    assert not any(secret in word for word in cleaned), cleaned


def test_a_command_line_without_secrets_is_left_as_it_is():
    for argv in (["python", "-c", "import time; time.sleep(3600)", "--use_auth_token", "True"],
                 ["git", "lfs", "pull", "--include", "*.bin"], ["python", "train.py", "--max-tokens", "512"],
                 ["python3", "-u", "-c", "x", "worker.py"], ["mkdir", "-p", "/data/x"],
                 ["ssh", "-p", "2222", "h"], ["find", ".", "-print"],
                 ["python", "train.py", "--author=bob", "--max-tokens=512"]):
        assert redact.redact_argv(argv) == argv


@pytest.mark.parametrize("flag", [
    "--hf-token", "--api-key", "--secret", "--auth-token", "--wandb-key", "--hub_token", "--key", "--keys",
    "--ssh-key", "--openai-key", "--encryption-key", "--azure-storage-key", "--auth", "--authorization",
    "--auth-header", "--cookies", "--session", "--session-id", "--secrets", "--ssh-key-passphrase",
    "--api-key-value", "--token-value", "--a-b-c-d-e-f-g-token", "--password", "--use-auth-token",
])
def test_a_flag_that_takes_a_secret_has_its_value_redacted(flag):
    assert redact.redact_text(f"run {flag} X1234567 --lr 3") == f"run {flag} <redacted> --lr 3"
    assert redact.redact_text(f"run {flag}='p&ss word'") == f"run {flag}=<redacted>"


def test_flags_beside_a_credential_word_that_hold_settings_are_left_alone():
    text = ("python train.py --max-tokens 512 --tokenizer gpt2 --tokens_per_batch 4096 --author Jane "
            "--sessions 3 --session-name run1 --key-column text --eos_token_id 2 --use_auth_token True "
            "--sort_key loss --primary_key id --max_session_len 100 --num_key_value_heads 8 --max_token_len "
            "2048 --token_budget 100 --keyframe-interval 10 --credits 5 --pad_token_id 0")
    assert redact.redact_text(text) == text


def test_redact_data_walks_nested_json():
    data = {"config": {"wandb_api_key": "abc", "n": 3, "urls": ["https://u:pw123456@h/x"]}}
    assert redact.redact_data(data) == {"config": {"wandb_api_key": "<redacted>", "n": 3,
                                                   "urls": ["https://u:<redacted>@h/x"]}}


def test_anonymize_text():
    text = "/home/ada/run on node-7.example by ada; ~ada; HOME=/root/x; adapter stays"
    out = redact.anonymize_text(text, ["node-7.example", "node-7"], ["ada"], ["/root"])
    assert out == "~/run on <host> by <user>; ~<user>; HOME=~/x; adapter stays"


# ---------------------------------------------------------------------------------------------
# executed notebooks

PNG = base64.b64encode(b"\x89PNG AKIAIOSFODNN7EXAMPLE" * 50).decode()


def executed_notebook(path: Path) -> Path:
    """An executed-looking notebook with secrets in every place papermill and outputs put them."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["papermill"] = {"parameters": {"hf_token": SECRET_ENV["HF_TOKEN"],
                                               "db_password": SECRET_ENV["DB_PASSWORD"],
                                               "report_dir": "reports/audit", "retries": 3}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {"m1": {"state": {"value": SECRET_ENV["GITHUB_TOKEN"]}}}}}
    injected = nbformat.v4.new_code_cell(
        f'# Parameters\nhf_token = "{SECRET_ENV["HF_TOKEN"]}"\n'
        f'db_password = "{SECRET_ENV["DB_PASSWORD"]}"\nreport_dir = "reports/audit"\n',
        metadata={"tags": ["injected-parameters"]})
    shown = nbformat.v4.new_code_cell("print(os.environ)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=(
            f"WANDB {SECRET_ENV['WANDB_API_KEY']}\nurl {SECRET_ENV['MASTER_ADDR']}\n"
            f"{SECRET_ENV['PRIVATE_KEY_PEM']}\n")),
        nbformat.v4.new_output("display_data", data={
            "text/html": f"<td>{SECRET_ENV['PYTORCH_BLOB_CONN']}</td>",
            "text/plain": f"{{'OPENAI_API_KEY': '{SECRET_ENV['OPENAI_API_KEY']}'}}",
            "image/png": PNG}),
        nbformat.v4.new_output("error", ename="RuntimeError",
                               evalue=f"auth failed for {SECRET_ENV['AWS_ACCESS_KEY_ID']}",
                               traceback=[f"line 1 token={SECRET_ENV['SLACK_BOT_TOKEN']}", "line 2"]),
    ])
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), injected, shown]
    nbformat.write(nb, str(path))
    return path


def test_scrub_notebook_removes_every_secret(tmp_path, secret_environment):
    path = executed_notebook(tmp_path / "run.ipynb")
    assert leaks(path.read_text())  # the crafted notebook does leak
    count = redact.scrub_notebook(path)
    text = path.read_text()
    assert count >= 10 and leaks(text) == []
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["papermill"]["parameters"]["report_dir"] == "reports/audit"
    assert nb.metadata["papermill"]["parameters"]["retries"] == 3
    assert nb.cells[2].outputs[1]["data"]["image/png"] == PNG  # binary data untouched
    assert nb.cells[2].outputs[2]["traceback"][1] == "line 2"
    assert 'report_dir = "reports/audit"' in nb.cells[1].source


def test_scrub_notebook_is_idempotent_and_leaves_clean_files_alone(tmp_path):
    path = executed_notebook(tmp_path / "run.ipynb")
    assert redact.scrub_notebook(path) > 0
    before = path.stat().st_mtime_ns, path.read_bytes()
    assert redact.scrub_notebook(path) == 0
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before


def test_scrub_notebook_without_environment_still_catches_shapes_and_parameters(tmp_path):
    path = executed_notebook(tmp_path / "run.ipynb")
    redact.scrub_notebook(path)
    text = path.read_text()
    for name in ("HF_TOKEN", "DB_PASSWORD", "GITHUB_TOKEN", "OPENAI_API_KEY", "AWS_ACCESS_KEY_ID"):
        assert SECRET_ENV[name] not in text, name
    assert "Sup3rS3cretPw" not in text


@pytest.mark.parametrize("content", ["not json", '{"no": "cells"}', "[1, 2]"])
def test_scrub_notebook_refuses_non_notebooks(tmp_path, content):
    path = tmp_path / "x.ipynb"
    path.write_text(content)
    with pytest.raises(ValueError, match="notebook"):
        redact.scrub_notebook(path)
    assert path.read_text() == content


def test_not_collected_names_are_credential_like():
    assert all(redact.is_credential_name(name) for name in NOT_COLLECTED if name != "DOCKER_AUTH_CONFIG")


@pytest.mark.parametrize("text", ["a-" * 100_000, "-" * 200_000, "a." * 100_000,
                                  ("ab.cd-" * 30_000) + "\nHF_TOKEN=abc123456"])
def test_large_outputs_stay_fast(text):
    """Long runs of dotted or dashed text once made the patterns backtrack quadratically."""
    import time

    started = time.perf_counter()
    cleaned = redact.redact_text(text)
    assert time.perf_counter() - started < 1.0  # ~0.03 s here; generous for a loaded machine
    assert cleaned.endswith("HF_TOKEN=<redacted>") or cleaned == text
