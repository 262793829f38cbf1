#!/usr/bin/env python3
"""RadixLM container entrypoint: engine settings from the environment, then the server.

Before it execs its arguments (``tritonserver --model-repository=...`` by default) it writes
engine settings given as environment variables into the Triton model repository, so one image
serves any model folder and engine tuning without rebuilding:

``RADIXLM_PARAM_<KEY>=<value>``
    sets ``parameters { key: "<key>" value: { string_value: "<value>" } }`` (key in lower
    case) in the engine model's ``config.pbtxt``, replacing an entry with that key; an empty
    value removes the key, so the engine falls back to its default (``max_total_tokens``
    unset: the KV pool is sized from ``mem_fraction_static``).
``RADIXLM_INSTANCE_GROUP=<list>``
    replaces the engine model's ``instance_group``, e.g. ``[ { count: 1, kind: KIND_GPU } ]``
    (one engine per GPU the container sees).
``RADIXLM_MODEL_PATH=<dir>``
    the Hugging Face model folder: sets the engine model's ``model_path`` (unless
    ``RADIXLM_PARAM_MODEL_PATH`` is given) and replaces the value of ``model_path`` or
    ``tokenizer_path`` parameters that the repository's other models already declare (the
    tokenizer models load their tokenizer from the same folder).
``RADIXLM_ENGINE_MODEL=<name>``
    folder of the engine model in the repository (default ``llm``).

The repository is the command's ``--model-repository``/``--model-store`` argument, else
``RADIXLM_MODEL_REPOSITORY``, else ``/models/model_repository``. The files are rewritten in
place, so a repository mounted read-only can't take settings this way (the entrypoint then
stops with an error rather than serve with settings other than those asked for).

tritonserver then runs as this process's child (this process stays PID 1), supervised as
``radixlm-serve`` supervises it (``backend/supervisor.py``): a stub that dies stops the
server, SIGTERM ends it within ``--exit-timeout-secs`` + 3 s (+ 5 s for its processes), and
the defaults of ``backend/server_flags.py`` are added to its flags (administrative APIs
behind ``RADIXLM_ADMIN_TOKEN``, a random one when it is not set). Commands other than
tritonserver (a shell, say) run untouched.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Iterator, Mapping

PARAM_PREFIX = "RADIXLM_PARAM_"
DEFAULT_REPOSITORY = "/models/model_repository"
DEFAULT_ENGINE_MODEL = "llm"
DEFAULT_COMMAND = ["tritonserver", f"--model-repository={DEFAULT_REPOSITORY}"]
SHARED_PATH_KEYS = ("model_path", "tokenizer_path")

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<number>[-+]?[0-9][0-9A-Za-z_.+-]*)
  | (?P<punct>[{}\[\]<>:,;])
    """,
    re.VERBOSE,
)
_UNESCAPE = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\"}


class ConfigError(Exception):
    """A config.pbtxt that this entrypoint can't read or write."""


def _tokens(text: str) -> Iterator[tuple[str, str, int, int]]:
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ConfigError(f"can't read config.pbtxt near {text[pos:pos + 30]!r}")
        kind = match.lastgroup or ""
        if kind not in ("space", "comment"):
            yield kind, match.group(), match.start(), match.end()
        pos = match.end()


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(1)), body)


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _top_level(tokens: list, field: str) -> list[tuple[int, int, int]]:
    """Top-level occurrences of ``field`` (``field [..]``, ``field {..}``, ``field: value``)
    as token indices: (its name, the first token of its value, the value's last token)."""
    found = []
    depth = 0
    i = 0
    while i < len(tokens):
        kind, value = tokens[i][0], tokens[i][1]
        if kind == "punct" and value in "{<[":
            depth += 1
        elif kind == "punct" and value in "}>]":
            depth -= 1
        elif depth == 0 and kind == "ident" and value == field:
            first = i + 1
            if first < len(tokens) and tokens[first][1] == ":":
                first += 1
            if first >= len(tokens):
                raise ConfigError(f"{field} has no value")
            last = first
            if tokens[first][1] in ("{", "<", "["):
                level = 0
                while last < len(tokens):
                    if tokens[last][0] == "punct" and tokens[last][1] in "{<[":
                        level += 1
                    elif tokens[last][0] == "punct" and tokens[last][1] in "}>]":
                        level -= 1
                        if level == 0:
                            break
                    last += 1
                else:
                    raise ConfigError(f"unclosed {field}")
            found.append((i, first, last))
            i = last
        i += 1
    return found


def _parameter_blocks(text: str) -> list[tuple[int, int, str | None, str | None]]:
    """Top-level ``parameters { ... }`` entries: (start, end, key, string_value)."""
    tokens = list(_tokens(text))
    blocks = []
    for name, first, last in _top_level(tokens, "parameters"):
        if tokens[first][1] not in ("{", "<"):
            raise ConfigError("only the `parameters { key: ... value: {...} }` form is supported")
        level = 0
        inner: list[tuple[int, str, str]] = []  # (level, kind, text) of the non-brackets
        for t_kind, t_value, _, _ in tokens[first:last]:
            if t_kind == "punct" and t_value in "{<[":
                level += 1
            elif t_kind == "punct" and t_value in "}>]":
                level -= 1
            else:
                inner.append((level, t_kind, t_value))
        key = string_value = None
        for n in range(len(inner) - 2):
            (lvl, k1, v1), (_, _, v2), (_, k3, v3) = inner[n], inner[n + 1], inner[n + 2]
            if k1 == "ident" and v2 == ":" and k3 == "string":
                if v1 == "key" and lvl == 1:
                    key = _unquote(v3)
                elif v1 == "string_value":
                    string_value = _unquote(v3)
        blocks.append((tokens[name][2], tokens[last][3], key, string_value))
    return blocks


def read_parameters(text: str) -> dict[str, str | None]:
    """The ``parameters`` map of a model config (the last entry of a key wins)."""
    return {key: value for _, _, key, value in _parameter_blocks(text) if key is not None}


def _entry(key: str, value: str) -> str:
    return f"parameters {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}\n"


def _cut(text: str, start: int, end: int) -> str:
    line_start = text.rfind("\n", 0, start) + 1
    if text[line_start:start].strip() == "":
        start = line_start
        newline = text.find("\n", end)
        if newline >= 0 and text[end:newline].strip() == "":
            end = newline + 1
    return text[:start] + text[end:]


def set_parameters(text: str, params: Mapping[str, str]) -> str:
    """Text with each of ``params`` as the only entry of its key (appended at the end);
    a key whose value is empty is removed."""
    if not params:
        return text
    for start, end, key, _ in sorted(_parameter_blocks(text), reverse=True):
        if key in params:
            text = _cut(text, start, end)
    if text and not text.endswith("\n"):
        text += "\n"
    return text + "".join(_entry(k, str(v)) for k, v in params.items() if str(v) != "")


def _field_spans(text: str, field: str) -> list[tuple[int, int]]:
    """Character spans of the top-level occurrences of ``field``."""
    tokens = list(_tokens(text))
    return [(tokens[name][2], tokens[last][3]) for name, _, last in _top_level(tokens, field)]


def set_field(text: str, field: str, value: str) -> str:
    """Text with ``field`` (a top-level field of the model config) set to ``value``, which
    is protobuf text (``[ { count: 1, kind: KIND_GPU } ]``)."""
    list(_tokens(value))  # refuses what it can't read
    for start, end in sorted(_field_spans(text, field), reverse=True):
        text = _cut(text, start, end)
    if text and not text.endswith("\n"):
        text += "\n"
    joiner = " " if value.lstrip()[:1] in ("[", "{") else ": "
    return f"{text}{field}{joiner}{value.strip()}\n"


def replace_parameters(text: str, params: Mapping[str, str]) -> str:
    """Like set_parameters, for only those keys the text already declares."""
    present = read_parameters(text)
    return set_parameters(text, {k: v for k, v in params.items() if k in present})


def engine_parameters(environ: Mapping[str, str]) -> dict[str, str]:
    params = {name[len(PARAM_PREFIX):].lower(): value for name, value in sorted(environ.items())
              if name.startswith(PARAM_PREFIX) and len(name) > len(PARAM_PREFIX)}
    model_path = environ.get("RADIXLM_MODEL_PATH")
    if model_path:
        params.setdefault("model_path", model_path)
    return params


def repository_from_args(args: list[str], environ: Mapping[str, str]) -> Path:
    for i, arg in enumerate(args):
        for flag in ("--model-repository", "--model-store"):
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
            if arg == flag and i + 1 < len(args):
                return Path(args[i + 1])
    return Path(environ.get("RADIXLM_MODEL_REPOSITORY", DEFAULT_REPOSITORY))


def apply(repository: Path, environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Write the settings into the repository; returns {config path: settings written}."""
    changes: dict[str, dict[str, str]] = {}
    params = engine_parameters(environ)
    engine_model = environ.get("RADIXLM_ENGINE_MODEL", DEFAULT_ENGINE_MODEL)
    engine_config = repository / engine_model / "config.pbtxt"
    instance_group = environ.get("RADIXLM_INSTANCE_GROUP", "").strip()
    if params or instance_group:
        if not engine_config.is_file():
            raise ConfigError(f"engine settings given but {engine_config} does not exist "
                              "(set RADIXLM_ENGINE_MODEL to the engine model's folder)")
        text = set_parameters(engine_config.read_text(), params)
        if instance_group:
            text = set_field(text, "instance_group", instance_group)
        _write(engine_config, text)
        changes[str(engine_config)] = dict(params)
        if instance_group:
            changes[str(engine_config)]["instance_group"] = instance_group
    model_path = environ.get("RADIXLM_MODEL_PATH")
    if model_path and repository.is_dir():
        shared = {key: model_path for key in SHARED_PATH_KEYS}
        for config in sorted(repository.glob("*/config.pbtxt")):
            if config == engine_config:
                continue
            text = config.read_text()
            updated = replace_parameters(text, shared)
            if updated != text:
                _write(config, updated)
                present = read_parameters(text)
                changes[str(config)] = {k: v for k, v in shared.items() if k in present}
    return changes


def _write(path: Path, text: str) -> None:
    if path.read_text() == text:
        return
    try:
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"can't write {path} ({exc.strerror}): mount the model repository "
                          "writable, or bake the settings into config.pbtxt") from None


def main(argv: list[str]) -> int:
    command = argv or list(DEFAULT_COMMAND)
    if Path(command[0]).name == "tritonserver":
        repository = repository_from_args(command, os.environ)
        model_path = os.environ.get("RADIXLM_MODEL_PATH")
        if model_path and not Path(model_path).is_dir():
            print(f"[radixlm-entrypoint] warning: model folder {model_path} does not exist",
                  file=sys.stderr, flush=True)
        try:
            changes = apply(repository, os.environ)
        except ConfigError as exc:
            print(f"[radixlm-entrypoint] error: {exc}", file=sys.stderr, flush=True)
            return 2
        for path, settings in changes.items():
            shown = ", ".join(f"{k}={v}" for k, v in settings.items())
            print(f"[radixlm-entrypoint] {path}: {shown}", flush=True)
        return serve(command)
    os.execvp(command[0], command)
    return 127  # not reached


def serve(command: list[str]) -> int:
    """tritonserver, hardened and supervised (the backend package is installed here)."""
    from backend.admin_access import ensure_token
    from backend.server_flags import bounds_for, hardened_args, server_plan
    from backend.supervisor import supervise

    env = dict(os.environ)
    token = ensure_token(env)
    try:
        command = [command[0]] + hardened_args(command[1:], token, os.getpid())
    except ValueError as exc:
        print(f"[radixlm-entrypoint] error: {exc}", file=sys.stderr, flush=True)
        return 2
    shown = " ".join(command).replace(token, "<admin token>")
    print(f"[radixlm-entrypoint] {shown}", flush=True)
    return supervise(server_plan(command, env, os.getpid()), bounds_for(command[1:], env))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
