"""Keeping secrets out of everything the suite writes: reports, logs, executed notebooks.

Three ways a secret is recognised:
- by the variable's name: names containing TOKEN, SECRET, PASSWORD, PASSWD, KEY, CREDENTIAL (CRED),
  AUTH, COOKIE, SESSION or PRIVATE, or a PASS / PW part, have their value replaced (``redact_env``);
- by the value's shape: Hugging Face, OpenAI, GitHub, AWS, Slack and Google keys, JWTs, bearer
  tokens, private key blocks, ``AccountKey=`` style connection strings, ``user:password@`` in URLs
  and ``NAME=value`` / ``"name": "value"`` pairs whose name is credential-like (``redact_text``);
- by the value itself: the values of the credential-like variables of the current environment are
  replaced wherever they appear (``redact_text``), so a token copied into a path is caught too.

``anonymize_text`` additionally replaces host names, user names and home folders; ``for_report``
does both, and names the repository ``<repo>``: text as a person should read it in a shared report.
Nothing here imports anything heavy: the CLI, ranks and the report suite call it freely.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from helpers import params
from helpers.report import atomic_write_text

REDACTED = "<redacted>"

# substrings of a variable name that mark its value as a credential
CREDENTIAL_NAME_PARTS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CRED", "AUTH", "COOKIE",
                         "SESSION", "PRIVATE")
# whole underscore-separated parts that do the same (PASS would also match PASSTHROUGH)
CREDENTIAL_NAME_WORDS = ("PASS", "PW", "PWD_HASH")
# values never worth hiding (and never worth replacing all over a text)
TRIVIAL_VALUES = frozenset({"", "0", "1", "true", "false", "yes", "no", "none", "null", "on", "off",
                            REDACTED})
MIN_SECRET_LENGTH = 6  # shorter values of credential variables are not searched for in free text
# names that match the credential parts but hold settings, not secrets
NOT_CREDENTIALS = frozenset({"TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "NCCL_IB_PKEY",
                             "HF_HUB_DISABLE_TELEMETRY"})

_NAME_CHARS = r"[A-Za-z0-9_.\-]{0,48}"  # bounded: a long dotted run must not go quadratic
_CRED_WORD = r"(?:TOKEN|SECRET|PASSWORD|PASSWD|KEY|CRED|AUTH|COOKIE|SESSION|PRIVATE)"

# a command-line flag that takes a secret (``is_secret_flag``): one of its parts (split at - and _) is
# a credential word, and no part beside it makes it a count, a name or a setting
_SECRET_PARTS = frozenset({"token", "secret", "secrets", "password", "passwd", "pass", "pwd", "passphrase",
                           "credential", "credentials", "cred", "creds", "apikey", "key", "keys", "auth",
                           "authorization", "cookie", "cookies", "session", "private"})
_SAFE_BEFORE = frozenset({  # --max-tokens, --eos-token-id, --sort-key, --num-key-value-heads
    "max", "min", "num", "n", "sort", "primary", "foreign", "group", "metric", "monitor", "label", "eos",
    "bos", "pad", "unk", "sep", "cls", "mask", "partition", "hash", "cache", "dict", "lookup", "index"})
_SAFE_AFTER = frozenset({  # --key-column, --session-name, --tokens-per-batch, --private-key-file
    "len", "length", "count", "size", "limit", "budget", "column", "col", "name", "names", "interval",
    "heads", "dim", "type", "per", "file", "path", "dir"})
_FLAG = r"--[A-Za-z0-9][A-Za-z0-9_\-]{0,80}"
# the programs that take a password or user:password after a short option (sshpass -p, mysql -p or
# -pSECRET, docker login -p, curl -u user:pass): elsewhere -p and -u mean other things (mkdir -p)
_SHORT_SECRET_OPTIONS = {"sshpass": {"-p"}, "mysql": {"-p"}, "mysqldump": {"-p"}, "docker": {"-p"},
                         "curl": {"-u"}, "mongo": {"-p"}}
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]{0,20}://)[^/\s@\"'<>]{1,256}@")  # https://TOKEN@host
_RANDOM_WORD = re.compile(r"^(?=.*\d)(?=.*[A-Za-z])[A-Za-z0-9_\-]{24,}$")  # a long key, given bare

# shapes of secrets: (cheap lowercase hints, pattern, replacement). A pattern runs only on text that
# contains one of its hints, which keeps redaction fast on large outputs. Replacements keep the
# non-secret prefix readable.
_SHAPES: list[tuple[tuple[str, ...], re.Pattern[str], str]] = [
    (("private key",),
     re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S), REDACTED),
    (("hf_",), re.compile(r"\bhf_[A-Za-z0-9]{16,}"), REDACTED),
    (("sk-",), re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"), REDACTED),
    (("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"),
     REDACTED),
    (("github_pat_",), re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), REDACTED),
    (("akia", "asia"), re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (("xox",), re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), REDACTED),
    (("aiza",), re.compile(r"\bAIza[0-9A-Za-z_\-]{35}"), REDACTED),
    (("eyj",), re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
     REDACTED),
    (("bearer", "basic", "token"),
     re.compile(r"(?i)\b(Bearer|Basic|Token)(\s+)[A-Za-z0-9._~+/\-]{12,}=*"), rf"\1\2{REDACTED}"),
    # connection strings: AccountKey=...; SharedAccessSignature=...; password=...
    (("key=", "signature=", "sig=", "password=", "passwd=", "pwd="),
     re.compile(r"(?i)\b(AccountKey|SharedAccessKey|SharedAccessSignature|sig|password|passwd|pwd)"
                r"=([^;&\s\"'<>]+)"), rf"\1={REDACTED}"),
    # scheme://user:password@host
    (("://",), re.compile(r"(?i)\b([a-z][a-z0-9+.\-]{0,20}://[^/\s:@\"'<>]{1,256}):([^/\s@\"'<>]{1,256})@"),
     rf"\1:{REDACTED}@"),
    # --hf-token VALUE / --password=VALUE / --api_key 'VALUE' on command lines: ``is_secret_flag``
    (("--",), re.compile(rf"({_FLAG})([ =])(?!<redacted>)('[^']*'|\"[^\"]*\"|[^\s\"']+)"),
     lambda match: f"{match[1]}{match[2]}{REDACTED}"
     if is_secret_flag(match[1]) and not _is_trivial(match[3].strip("'\"")) else match[0]),
]
_CRED_ANY = re.compile(_CRED_WORD, re.I)
# NAME=value, NAME: value, "name": "value", name = 'value' where NAME is credential-like
_ASSIGNMENT = re.compile(
    rf"(?i)(?P<name>\b{_NAME_CHARS}{_CRED_WORD}{_NAME_CHARS})"
    r"(?P<close>['\"]?\]?)(?P<sep>\s*[=:]\s*)(?P<quote>['\"]?)(?P<value>[^\s'\",;&<>)}\]]+)"
)


def is_secret_flag(flag: str) -> bool:
    """Does a command-line flag take a secret: one of its parts is a credential word (--hf-token,
    --api-key, --ssh-key, --auth-header, --session, --client-secret) and neither part beside that
    word makes it a count, a name or a setting (--max-tokens, --eos-token-id, --key-column,
    --sort-key, --session-name, --private-key-file)? The plain words --tokenizer and --author are
    none."""
    parts = [part for part in re.split(r"[-_]+", flag.lstrip("-").lower()) if part]
    for index, part in enumerate(parts):
        if part not in _SECRET_PARTS:
            continue
        before = parts[index - 1] if index else ""
        after = parts[index + 1] if index + 1 < len(parts) else ""
        if before not in _SAFE_BEFORE and after not in _SAFE_AFTER:
            return True
    return False


def is_credential_name(name: str) -> bool:
    """True when a variable (or key) called ``name`` holds a credential by its name alone."""
    upper = name.upper()
    if upper in NOT_CREDENTIALS:
        return False
    if any(part in upper for part in CREDENTIAL_NAME_PARTS):
        return True
    return any(word in upper.replace("-", "_").split("_") for word in CREDENTIAL_NAME_WORDS)


def _is_trivial(value: str) -> bool:
    return value.strip().lower() in TRIVIAL_VALUES


def _assignment(match: re.Match[str]) -> str:
    name, quote, value = match["name"], match["quote"], match["value"]
    tail = re.split(r"[.\-]", name)[-1]  # ``x.HF_TOKEN`` -> ``HF_TOKEN``
    code_like = not quote and not tail.isupper()  # ``sorted(x, key=len)`` is code, not a secret
    raised = tail.endswith(("Error", "Exception"))  # ``KeyError: 'labels'``: the missing key, the clue
    if code_like or raised or _is_trivial(value) or not is_credential_name(name):
        return match.group(0)
    return f"{name}{match['close']}{match['sep']}{quote}{REDACTED}"


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the credential-like variables of ``environ`` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return [value for name, value in environ.items()
            if is_credential_name(name) and len(value) >= MIN_SECRET_LENGTH and not _is_trivial(value)]


_value_pattern_cache: dict[tuple[str, ...], re.Pattern[str] | None] = {}


def _values_pattern(values: Iterable[str]) -> re.Pattern[str] | None:
    key = tuple(sorted({v for v in values if v and len(v) >= 3 and not _is_trivial(v)},
                       key=lambda v: (-len(v), v)))
    if key not in _value_pattern_cache:
        if len(_value_pattern_cache) > 64:
            _value_pattern_cache.clear()
        _value_pattern_cache[key] = re.compile("|".join(map(re.escape, key))) if key else None
    return _value_pattern_cache[key]


def redact_text_count(text: str, extra_values: Iterable[str] = ()) -> tuple[str, int]:
    """``redact_text`` that also says how many replacements it made."""
    return _redact(text, _values_pattern([*environment_secrets(), *extra_values]))


def _redact(text: str, values: re.Pattern[str] | None) -> tuple[str, int]:
    total = 0
    if values is not None:
        text, count = values.subn(REDACTED, text)
        total += count
    lower = text.lower()
    for hints, shape, replacement in _SHAPES:
        if any(hint in lower for hint in hints):
            text, count = shape.subn(replacement, text)
            total += count
    if _CRED_ANY.search(text):  # only lines naming a credential can hold NAME=value
        lines = text.splitlines(keepends=True)
        cleaned = [_ASSIGNMENT.sub(_assignment, line) if _CRED_ANY.search(line) else line
                   for line in lines]
        total += sum(a != b for a, b in zip(lines, cleaned, strict=True))
        text = "".join(cleaned)
    return text, total


def redact_text(text: str, extra_values: Iterable[str] = ()) -> str:
    """``text`` with every secret replaced by ``<redacted>``.

    Replaces the values of the current environment's credential-like variables, any of
    ``extra_values``, and values that look like secrets (see the module docstring).
    """
    return redact_text_count(text, extra_values)[0]


def redact_argv(words: Iterable[str]) -> list[str]:
    """A command line's words (the program first) with their secrets replaced, word by word (a value
    quoted or with spaces is one word here, where text would split it): the value after a flag that
    takes a secret (--password X, --hf-token X; -p X and -u X for the programs that take a password
    there: sshpass, mysql, docker login, curl), a --flag=value or NAME=value whose name is a
    credential's, a URL's user part, a long bare word of letters and digits (a key given by
    position), then ``redact_text``'s shapes and values."""
    words = list(words)
    short = _SHORT_SECRET_OPTIONS.get(Path(words[0]).name, set()) if words else set()
    cleaned: list[str] = []
    secret_next = False
    for word in words:
        if secret_next and not _is_trivial(word):
            cleaned.append(REDACTED)
        elif short and word[:2] in short and len(word) > 2 and not word.startswith("--"):
            cleaned.append(word[:2] + REDACTED)  # mysql -pSECRET
        else:
            cleaned.append(_redact_word(word))
        secret_next = word in short or (word.startswith("-") and "=" not in word and is_secret_flag(word))
    return cleaned


def _redact_word(word: str) -> str:
    """One word of a command line (``redact_argv``): the secret in it replaced."""
    name, equals, value = word.partition("=")
    if equals and value and not _is_trivial(value) and (
            is_secret_flag(name) if name.startswith("-") else is_credential_name(name)):
        return f"{name}={REDACTED}"
    if _RANDOM_WORD.match(word):
        return REDACTED
    return redact_text(_USERINFO.sub(rf"\1{REDACTED}@", word))


def redact_env(mapping: Mapping[str, str], extra_values: Iterable[str] = ()) -> dict[str, str]:
    """A copy of ``mapping`` (name -> value) with credentials replaced by ``<redacted>``.

    A credential-like name hides its whole value; other values are passed through ``redact_text``,
    which catches secrets hidden inside harmless variables (a token in a URL, say).
    """
    secrets = [*extra_values, *environment_secrets(mapping)]
    return {name: (REDACTED if is_credential_name(name) and value else redact_text(value, secrets))
            for name, value in mapping.items()}


def redact_data(value: Any, extra_values: Iterable[str] = ()) -> Any:
    """Redact every string inside JSON-like data; values under credential-like keys are hidden."""
    extra = list(extra_values)
    if isinstance(value, str):
        return redact_text(value, extra)
    if isinstance(value, dict):
        return {key: (REDACTED if is_credential_name(str(key)) and isinstance(item, str) and item
                      else redact_data(item, extra))
                for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(item, extra) for item in value]
    return value


# ---------------------------------------------------------------------------------------------
# anonymising: host names, user names, home folders


_HOME_PATH = re.compile(r"(?<![\w.-])/(?:home|Users)/[^/\s\"'<>]+")


def anonymize_text(text: str, hostnames: Iterable[str] = (), users: Iterable[str] = (),
                   homes: Iterable[str] = ()) -> str:
    """Replace home folders by ``~``, user names by ``<user>`` and host names by ``<host>``.

    Any ``/home/NAME`` or ``/Users/NAME`` counts as a home folder, so facts read from another
    machine are anonymised too.
    """
    text = _HOME_PATH.sub("~", text)
    for home in sorted({h.rstrip("/") for h in homes if h and h.rstrip("/")}, key=len, reverse=True):
        if home != "/":
            text = re.sub(re.escape(home) + r"(?=/|\b|$)", "~", text)
    for host in sorted({h for h in hostnames if h and h != "localhost"}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", text)
    for user in sorted({u for u in users if u}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(user)}(?![\w-])", "<user>", text)
    return text


def anonymize_data(value: Any, hostnames: Iterable[str] = (), users: Iterable[str] = (),
                   homes: Iterable[str] = ()) -> Any:
    """``anonymize_text`` applied to every string (keys included) inside JSON-like data."""
    args = (list(hostnames), list(users), list(homes))
    if isinstance(value, str):
        return anonymize_text(value, *args)
    if isinstance(value, dict):
        return {anonymize_text(str(k), *args): anonymize_data(v, *args) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [anonymize_data(item, *args) for item in value]
    return value


def local_identity() -> dict[str, list[str]]:
    """This machine's host names, user names and home folders, for ``anonymize_text``."""
    import getpass
    import socket

    users = {os.environ.get(name, "") for name in ("USER", "LOGNAME", "USERNAME")}
    try:
        users.add(getpass.getuser())
    except (KeyError, OSError):
        pass
    homes = {os.environ.get("HOME", ""), str(Path.home())}
    hostname = socket.gethostname()
    return {"hostnames": sorted({hostname, hostname.split(".")[0]} - {""}),
            "users": sorted(users - {""}), "homes": sorted(homes - {"", "/"})}


# ---------------------------------------------------------------------------------------------
# executed notebooks

_BINARY_MIME = ("image/", "application/pdf", "video/", "audio/")


def for_report(text: str) -> str:
    """Text fit for a shared report: secrets redacted, the repository's folder shown as ``<repo>``,
    this machine's host and user names and home folders replaced."""
    text = redact_text(text).replace(str(params.REPO_ROOT), "<repo>")
    return anonymize_text(text, **local_identity())


def scrub_notebook(path: str | Path, extra_values: Iterable[str] = ()) -> int:
    """Remove every secret from an executed notebook in place (atomically); return the count.

    Covers cell sources (papermill's injected-parameters cell included), outputs (streams, rich
    data, error tracebacks), cell and notebook metadata (papermill's recorded parameters, widget
    state). Binary outputs (images) are left as they are. The file is rewritten only when
    something changed. Raises ValueError when ``path`` is not a notebook.
    """
    path = Path(path)
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"path must be a readable .ipynb notebook; {path}: {exc}") from None
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise ValueError(f"path must be a Jupyter notebook (no 'cells' list in {path})")
    scrubber = _Scrubber(list(extra_values))
    cleaned = scrubber.walk(notebook, ())
    if scrubber.count:
        atomic_write_text(path, json.dumps(cleaned, indent=1, ensure_ascii=False) + "\n")
    return scrubber.count


class _Scrubber:
    """Walks notebook JSON, redacting strings and counting what it replaced."""

    def __init__(self, extra_values: list[str]):
        self.values = _values_pattern([*environment_secrets(), *extra_values])
        self.count = 0

    def text(self, text: str) -> str:
        new, count = _redact(text, self.values)
        self.count += count
        return new

    def walk(self, value: Any, keys: tuple[str, ...]) -> Any:
        key = keys[-1] if keys else ""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            if value and all(isinstance(item, str) for item in value) and key != "traceback":
                return self._lines(value)  # a multi-line string split into lines
            return [self.walk(item, keys) for item in value]
        if isinstance(value, dict):
            return {name: self._item(name, item, keys) for name, item in value.items()}
        return value

    def _item(self, name: str, item: Any, keys: tuple[str, ...]) -> Any:
        if name.startswith(_BINARY_MIME):
            return item
        if keys[-2:] == ("papermill", "parameters") and is_credential_name(name):
            if item not in ("", None, REDACTED):
                self.count += 1
                return REDACTED
            return item
        return self.walk(item, (*keys, name))

    def _lines(self, lines: list[str]) -> list[str]:
        """Redact the joined text (a private key spans lines), keep the line split."""
        joined = "".join(lines)
        new = self.text(joined)
        return lines if new == joined else new.splitlines(keepends=True)
