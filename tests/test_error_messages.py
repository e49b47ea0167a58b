"""Every user-facing error names what is wrong and how to fix it.

The messages are collected from the source: each `raise <JaxtronError subclass>(...)` and each
`_check(condition, message)` of the config validator, in every module. A message passes when
- it names what is wrong: a config field that exists in the schema (`mesh.tensor`), a flag some
  command declares (`--devices`), an environment variable, a file or folder, or a formatted
  value whose name says it holds one (`{path}`, `{prefix}`, `{flag}`);
- every field and flag it names exists (a misspelt one sends the user astray);
- it gives a concrete fix: a requirement with its value ("must be >= 1", "needs
  pipeline.microbatches=4"), an example to copy ("e.g. 80GiB"), or an instruction whose clause
  holds what to do it with (a field, a flag, a value, a command, a file), not a bare "check it".
A few are also triggered for real, end to end, and the lint's own verdicts are tested on
messages that must fail it.
"""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from conftest import run_in_process

PACKAGE = Path(__file__).parent.parent / "jaxtron"
USER_ERRORS = {"JaxtronError", "ConfigError", "DataError", "CheckpointError", "LaunchError",
               "NonFiniteError", "DamagedCheckpoint", "RunDirError"}
SLOT = "\u27e8\u27e9"  # where a formatted value stands in a message's template


def config_paths() -> set[str]:
    """Every `section.field` the config schema declares."""
    from jaxtron.config.schema import Config
    return {f"{section.name}.{field.name}" for section in dataclasses.fields(Config)
            for field in dataclasses.fields(section.default_factory())}


def command_flags() -> set[str]:
    """Every `--flag` a jaxtron command declares (argparse's add_argument)."""
    flags = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str) and a.value.startswith("--")}
    return flags


PATHS, FLAGS = config_paths(), command_flags()
SECTIONS = sorted({p.split(".")[0] for p in PATHS})
# A config field as written in a message (not a module path such as jaxtron.data.prepare, nor
# a field whose name a formatted value completes, such as mesh.dcn_{axis}).
DOTTED = re.compile(rf"(?<![\w.])(?:{'|'.join(SECTIONS)})\.[a-z_0-9]+\b(?![{SLOT[0]}*])")
SOME_FIELD = re.compile(rf"(?<![\w.])(?:{'|'.join(SECTIONS)})\.[a-z_]*(?:\*|{SLOT})|\b[a-z_]+=")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ENV = re.compile(r"\b(?:JAX|JAXTRON|XLA|SLURM|CUDA|NCCL|TPU)_[A-Z_]+\b")
FILE_WORDS = re.compile(r"\b(?:file|folder|directory|run dir|environment variable)\b|\.(?:json|bin|idx|yaml|jsonl|"
                        r"safetensors|txt)\b|\bconfig\.json\b")
# A formatted value names the thing when its last identifier says what it holds.
NAMING_VALUES = {"path", "prefix", "where", "directory", "dir", "folder", "file", "flag", "field",
                 "key", "dotted", "src", "out", "name", "location", "spec", "source", "missing",
                 "run_dir", "hf_dir", "checkpoint", "jsonl", "tokenizer", "input_path", "parts"}
# What a user is told to do: a verb, then (within the clause) what to do it with.
VERBS = re.compile(r"\b(?:set|use|pass|give|add|remove|delete|run|point|lower|raise|choose|"
                   r"install|fix|rename|shorten|move|resume|start|export|prepare|convert|"
                   r"download|write|put|make|increase|reduce|split|keep|launch|relaunch|"
                   r"restart|free|create|align|divide|pick|change|drop|lengthen|save|wait|"
                   r"rerun|copy|free|mount|unset|append|re-export)\b", re.I)
CONCRETE = re.compile(rf"{DOTTED.pattern}|{FLAG.pattern}|{ENV.pattern}|{SLOT}|\d|`[^`]+`|"
                      r"'[^']+'|\bpython -m\b|\bpip install\b|" + FILE_WORDS.pattern +
                      r"|\b(?:another|a new|a smaller|a larger|fewer|more|one|every|each|"
                      r"at least|at most|a finite|a positive|a number|the same|instead|again|"
                      r"explicit|that line|the key|the spelling|the syntax|null)\b|\w=\w|"
                      r"\be\.g\.|\bfor example\b|\bsuch as\b")
REQUIREMENT = re.compile(rf"\bmust (?:be|have|hold|divide|equal|match|exceed|name|come|stay|"
                         rf"not|keep|differ|sum|list|give|lie|sit)\b[^.;]*?(?:\d|{SLOT}|"
                         rf"{DOTTED.pattern}|{FLAG.pattern}|positive|finite|one of|a |an |"
                         r"true|false|set|empty|whole|unique|even)|\bmust (?:look like|cover)\b|\bneeds? [^.;]*?(?:=|\d|"
                         rf"{DOTTED.pattern}|{FLAG.pattern})", re.I)


EXAMPLE = re.compile(r"\be\.g\.|\bfor example\b|\bsuch as\b|\bas in\b")  # a value to copy


def _message_parts(node):
    """(template with SLOT where each formatted value goes, the formatted expressions)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, []
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else SLOT for v in node.values)
        return text, [ast.unparse(v.value) for v in node.values
                      if isinstance(v, ast.FormattedValue)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (a, av), (b, bv) = _message_parts(node.left), _message_parts(node.right)
        return a + b, av + bv
    return SLOT, [ast.unparse(node)]


def collect_messages():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            message = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                if name in USER_ERRORS and node.exc.args:
                    message = node.exc.args[0]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_check"
                  and len(node.args) == 2):
                message = node.args[1]
            if message is not None and not isinstance(message, ast.Name):  # _check's own raise
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}",
                              *_message_parts(message)))
    return found


MESSAGES = collect_messages()


def names_what_is_wrong(text: str, values: list[str]) -> bool:
    """A real config field, a real flag, an environment variable, a file, or a formatted
    value whose name says it holds one of those."""
    if any(p.search(text) for p in (DOTTED, SOME_FIELD, FLAG, ENV, FILE_WORDS)):
        return True
    for value in values:
        names = re.findall(r"[A-Za-z_]\w*", value)
        if any(name.endswith(tuple(NAMING_VALUES)) for name in names[:1] + names[-1:]):
            return True
    return False


def gives_a_fix(text: str) -> bool:
    """A requirement with its value (`must be >= 1`, `needs pipeline.microbatches >= 4`), or an
    instruction whose clause holds something concrete to do it with."""
    if REQUIREMENT.search(text) or EXAMPLE.search(text):
        return True
    for verb in VERBS.finditer(text):
        clause = re.split(r"[.;]\s", text[verb.end():], maxsplit=1)[0]
        if CONCRETE.search(clause):
            return True
    return False


def wrong_names(text: str) -> list[str]:
    """Config fields and flags a message names that do not exist (a typo sends users astray)."""
    fields = [d for d in DOTTED.findall(text) if d not in PATHS]
    flags = [f for f in FLAG.findall(text) if f not in FLAGS and not f.startswith("--xla")]
    return fields + flags


def test_there_are_many_messages_to_check():
    assert len(MESSAGES) > 200  # config, data, checkpoint and launch errors all found


@pytest.mark.parametrize("where, text, values", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_message_names_the_field_and_the_fix(where, text, values):
    assert names_what_is_wrong(text, values), f"{where}: names no field: {text!r}"
    assert gives_a_fix(text), f"{where}: gives no concrete fix: {text!r}"
    assert not wrong_names(text), f"{where}: names what does not exist: {wrong_names(text)}"


@pytest.mark.parametrize("text, values, what", [
    ("the value is bad; check it.", [], "no field"),
    ("model.d_model is bad; name it.", [], "no fix"),
    ("model.d_modle must be >= 1.", [], "wrong name"),
    ("--stepz must be at least 1.", [], "wrong name"),
    (f"the checkpoint is damaged ({SLOT}).", ["self.name_of_thing"], "no field"),
])
def test_the_lint_refuses_messages_without_a_real_field_or_fix(text, values, what):
    verdict = {"no field": not names_what_is_wrong(text, values),
               "no fix": not gives_a_fix(text), "wrong name": bool(wrong_names(text))}
    assert verdict[what]


@pytest.mark.parametrize("args, expected", [
    (["mesh.data=2", "mesh.tensor=3"], "multiply to 6, but 8 devices"),
    (["model.d_modle=64"], "Did you mean model.d_model?"),
    (["data.path=/nonexistent/corpus"], "data.path"),
    (["train.init_from=/nonexistent/export"], "python -m jaxtron.export"),
    (["distributed.num_processes=2"], "distributed.process_id"),
])
def test_bad_input_stops_the_cli_with_one_readable_line(args, expected, tmp_path):
    """The command's `main` as `python -m jaxtron.train` runs it (a process of its own for the
    same: tests/test_config.py)."""
    result = run_in_process("jaxtron.train", "--config", "configs/tiny.yaml",
                            f"train.run_dir={tmp_path}", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert "Traceback" not in result.stderr
