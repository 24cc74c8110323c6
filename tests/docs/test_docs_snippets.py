"""Every code snippet of README.md and docs/*.md runs here, so a snippet a newcomer copies works.

How each fenced block is treated, by its language:

- ``python``: the blocks of one page run in order in one namespace (a page reads like a
  notebook: a later block may use an earlier one's names), with the names in :data:`GIVEN`
  that the page's prose says come from elsewhere.
- ``bash``: each ``offload-core`` / ``python -m offload_core`` command runs in-process, in a
  scratch folder, and must exit 0; ``pip install`` must name extras that pyproject.toml defines,
  ``pytest -m`` markers that it declares; anything else (``python3 -m venv``) is left alone.
- ``toml``: parses.
- ``console`` (a transcript: ``$ command`` lines, then their output) and a block marked with
  ``<!-- snippet: checked, not run: WHY -->`` on the line before its fence: not run; each
  ``offload-core`` command (also one torchrun starts) is parsed by the real parser (so every
  subcommand and flag exists),
  and each call in Python code of an ``offload_core`` function binds to its signature.
- other fences (``text``, none) are output or diagrams, not code.

The mapping that lets snippets written for real models run on this machine (no downloads, a
CPU): every path or Hub id in :data:`TINY` is replaced by a folder holding the tiny pipeline of
the same class (``offload_core.tiny``, saved with ``save_pretrained``), and a call of that
pipeline runs with the tiny pipeline's own settings (its sizes, two steps, its sequence length),
the snippet's prompt and other arguments kept.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!-- snippet: checked, not run: (.+?) -->\s*\Z")
RUN_LANGUAGES = {"python", "bash", "toml"}
CHECK_LANGUAGES = {"console"}

#: a model path or Hub id in the docs -> the tiny pipeline of the same class that replaces it
TINY = {
    "black-forest-labs/FLUX.2-dev": "flux2",
    "/models/FLUX.2-dev": "flux2",
    "/models/Wan2.2-T2V-A14B-Diffusers": "wan2.2-t2v",
}

pytestmark = pytest.mark.quick


@dataclass
class Snippet:
    page: Path
    line: int
    language: str
    code: str
    not_run: str | None  # why, when the block is marked

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        language = match.group(1)
        if language not in RUN_LANGUAGES | CHECK_LANGUAGES:
            continue
        mark = MARK.search(text[: match.start()].rstrip() + "\n")
        line = text.count("\n", 0, match.start()) + 1
        found.append(Snippet(page, line, language, match.group(2), mark.group(1) if mark else None))
    return found


ALL = [s for page in PAGES for s in snippets(page)]


def test_the_snippets_are_found():
    """The fence pattern sees the pages' blocks (a changed fence style would silently test nothing)."""
    languages = {s.language for s in ALL}
    assert {"python", "bash", "toml", "console"} <= languages
    assert len([s for s in ALL if s.page.name == "README.md"]) >= 3


# -- the tiny stand-ins -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Per tiny pipeline name: (a folder it was saved to, the tiny pipeline)."""
    from offload_core.tiny import build_pipeline

    made = {}
    for name in sorted(set(TINY.values())):
        tiny = build_pipeline(name)
        folder = tmp_path_factory.mktemp(name)
        tiny.pipe.save_pretrained(folder)
        made[name] = (folder, tiny)
    return made


@contextlib.contextmanager
def tiny_calls(tiny_folders):
    """Calls of each stand-in's pipeline class run with the tiny pipeline's settings."""
    patched = []
    for _, tiny in tiny_folders.values():
        cls = type(tiny.pipe)
        if any(c is cls for c, _ in patched):
            continue
        settings = {k: v for k, v in tiny.call_kwargs.items() if k not in ("prompt", "output_type", "image")}
        original = cls.__call__

        def call(self, *args, _original=original, _settings=settings, **kwargs):
            return _original(self, *args, **{**kwargs, **_settings})

        patched.append((cls, original))
        cls.__call__ = call
    try:
        yield
    finally:
        for cls, original in patched:
            cls.__call__ = original


def swap_models(code: str, tiny_folders) -> str:
    for model, name in TINY.items():
        code = code.replace(f'"{model}"', repr(str(tiny_folders[name][0]))).replace(model, str(tiny_folders[name][0]))
    return code


def given(page: Path, tiny_folders) -> dict:
    """Names a page's prose says come from elsewhere."""
    if page.name == "index.md":  # "pipe": the pipeline of the README's quick start
        return {"pipe": tiny_folders["flux2"][1].pipe}
    if page.name == "bigger-than-ram.md":  # prompt embeddings "computed elsewhere"
        tiny = tiny_folders["flux2"][1]
        with torch.no_grad():
            embeds, _ = tiny.pipe.encode_prompt(
                prompt="a lighthouse at dusk", device="cpu", max_sequence_length=tiny.call_kwargs["max_sequence_length"],
                text_encoder_out_layers=tiny.call_kwargs["text_encoder_out_layers"],
            )
        return {"prompt_embeds": embeds.to(torch.bfloat16)}  # as the bf16 pipeline's own encoder gives them
    return {}


# -- running and checking ----------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block or transcript: lines (``$ `` prompts removed, output lines of
    a transcript dropped), split at ``&&``, comments dropped."""
    found = []
    for line in code.splitlines():
        if line.startswith("$ "):
            line = line[2:]
        elif line.strip() and not line.startswith(("offload-core", "python", "pip", "pytest", "torchrun", "#")):
            continue  # a transcript's output
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                found.append(words)
    return found


def offload_core_argv(words: list[str]) -> list[str] | None:
    """The arguments of an ``offload-core`` command (or ``python -m offload_core``, or torchrun
    starting it), else None."""
    if words[0] == "offload-core":
        return words[1:]
    if words[0] == "torchrun" and "offload_core" in words:
        return words[words.index("offload_core") + 1:]
    if words[:3] in (["python", "-m", "offload_core"], ["python3", "-m", "offload_core"]):
        return words[3:]
    return None


def check_other_command(words: list[str]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    if words[:2] == ["pip", "install"]:
        extras = pyproject["project"]["optional-dependencies"]
        for word in words[2:]:
            match = re.fullmatch(r"(?:-e\s*)?\.?\[([\w,-]+)\]", word.strip("\"'"))
            if match:
                assert set(match.group(1).split(",")) <= set(extras), f"pip install {word}: no such extra"
    if words[0] == "pytest" and "-m" in words:
        declared = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
        used = set(re.findall(r"\w+", words[words.index("-m") + 1])) - {"not", "and", "or"}
        assert used <= declared, f"pytest -m {used - declared}: undeclared marker"
    if words[:2] == ["python", "-m"] and words[2].startswith("offload_core."):
        import importlib.util

        assert importlib.util.find_spec(words[2]) is not None, f"no module {words[2]}"


def check_python(snippet: Snippet) -> None:
    """Every call of an ``offload_core`` function binds to its signature."""
    tree = ast.parse(snippet.code)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "offload_core":
            function = getattr(offload_core, node.func.attr)
            arguments = [None] * len(node.args)
            keywords = {k.arg: None for k in node.keywords if k.arg is not None}
            inspect.signature(function).bind(*arguments, **keywords)


@pytest.mark.parametrize("snippet", [s for s in ALL if s.not_run or s.language in CHECK_LANGUAGES], ids=str)
def test_snippets_not_run_are_checked(snippet, capsys):
    if snippet.language == "python":
        check_python(snippet)
        return
    for words in commands(snippet.code):
        argv = offload_core_argv(words)
        if argv is None:
            check_other_command(words)
            continue
        parser = cli.build_parser()
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version
            assert exc.code == 0
        capsys.readouterr()


def _pages_with_code_to_run():
    return sorted({s.page for s in ALL if not s.not_run and s.language in RUN_LANGUAGES})


@pytest.mark.parametrize("page", _pages_with_code_to_run(), ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(page, tiny_folders, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"snippets_of_{page.stem}", **given(page, tiny_folders)}
    for snippet in [s for s in snippets(page) if not s.not_run and s.language in RUN_LANGUAGES]:
        code = swap_models(snippet.code, tiny_folders)
        if snippet.language == "toml":
            tomllib.loads(code)
        elif snippet.language == "python":
            with tiny_calls(tiny_folders):
                try:
                    exec(compile(code, str(snippet), "exec"), namespace)
                except Exception as exc:
                    raise AssertionError(f"{snippet} fails: {type(exc).__name__}: {exc}") from exc
            for value in namespace.values():
                if isinstance(value, offload_core.OffloadHandle) and value.enabled:
                    value.disable()
        else:
            for words in commands(code):
                argv = offload_core_argv(words)
                if argv is None:
                    check_other_command(words)
                    continue
                code_ = cli.main(argv)
                assert code_ == 0, f"{snippet}: {shlex.join(words)} exited {code_}: {capsys.readouterr().err}"
        capsys.readouterr()


def test_the_enable_options_are_the_config_fields():
    """enable_offload's and from_pretrained's keyword-only parameters are OffloadConfig's fields,
    with the same defaults (so the signature IDEs show is the whole and true list)."""
    import dataclasses

    fields = {f.name: f.default for f in dataclasses.fields(offload_core.OffloadConfig)}
    for function, extra in ((offload_core.enable_offload, set()), (offload_core.from_pretrained, {"torch_dtype"})):
        keyword_only = {
            name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in extra
        }
        assert keyword_only == fields, function.__name__
        assert all(p.annotation is not inspect.Parameter.empty
                   for p in inspect.signature(function).parameters.values()), function.__name__
