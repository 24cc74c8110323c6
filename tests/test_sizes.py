"""The size table of docs/index.md ("Sizes"), row by row: every form it lists means what the row
says for every option that takes a size, and on the command line a string reaches the options
unchanged (so it means the same there), or is refused as the API refuses it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from offload_core import OffloadConfig, OffloadConfigError
from offload_core.cli import build_parser
from offload_core.cli.common import UsageError

pytestmark = pytest.mark.quick

DOC = Path(__file__).resolve().parents[1] / "docs" / "index.md"
TABLE = re.compile(r"<!-- size table: .*? -->\n\| you write \| it means \|\n\| --- \| --- \|\n((?:\|.*\|\n)+)")
BUDGETS = ("device_memory", "pinned_memory", "host_memory")
FLAGS = {"device_memory": "--device-memory", "pinned_memory": "--pinned-memory", "host_memory": "--host-memory",
         "activation_memory": "--activation-memory"}


def rows() -> list[tuple[str, list[object], str]]:
    """(the first cell as written, the Python values it lists, the second cell) of each row."""
    table = TABLE.search(DOC.read_text(encoding="utf-8"))
    assert table, "the size table of docs/index.md was not found"
    found = []
    for line in table.group(1).splitlines():
        written, meaning = (cell.strip() for cell in line.strip("|").split("|"))
        found.append((written, [ast.literal_eval(form) for form in re.findall(r"`([^`]+)`", written)], meaning))
    return found


def config(option: str, value: object) -> OffloadConfig:
    extra = {"device_memory": "1GiB"} if option == "activation_memory" else {}
    return OffloadConfig(enable_layerwise_offload=True, **{option: value, **extra})


def meaning(option: str, value: object) -> tuple[str, object]:
    """What ``option=value`` reads as: ("bytes", n), ("fraction", f) or ("auto", None)."""
    c = config(option, value)
    if option == "activation_memory":
        return ("auto", None) if c.activation_memory is None else ("bytes", c.activation_memory)
    parsed = {"device_memory": c.device_budget, "pinned_memory": c.pinned_budget, "host_memory": c.host_budget}[option]
    if parsed.auto:
        return "auto", None
    return ("bytes", parsed.nbytes) if parsed.nbytes is not None else ("fraction", parsed.fraction)


def flag(option: str, text: str) -> object:
    args = build_parser().parse_args(["plan", FLAGS[option], text])
    return getattr(args, option)


def test_the_table_lists_the_forms_this_test_checks():
    kinds = [written.split(":")[0] if written.startswith("refused") else "accepted" for written, _, _ in rows()]
    assert kinds.count("refused") >= 3 and kinds.count("accepted") >= 8, kinds


@pytest.mark.parametrize("written, forms, means", rows(), ids=[r[0] for r in rows()])
def test_every_form_of_the_table_means_what_it_says(written, forms, means):
    assert forms, f"a row without a form: {written}"
    options = (*BUDGETS, "activation_memory")
    if written.startswith("refused"):
        expected = {option: None for option in options}
    elif means.startswith("a fraction"):
        fraction = next(f for f in forms if isinstance(f, float))
        expected = {**{option: ("fraction", fraction) for option in BUDGETS}, "activation_memory": None}
    elif means.startswith("the option's default"):
        expected = {**{option: ("auto", None) for option in BUDGETS}, "activation_memory": "none only"}
    else:
        nbytes = int(re.match(r"([\d,]+) bytes", means).group(1).replace(",", ""))
        expected = {option: ("bytes", nbytes) for option in options}
    for option, wanted in expected.items():
        for form in forms:
            if wanted == "none only":  # activation_memory: None is its default, "auto" is not a size
                wanted_here = ("auto", None) if form is None else None
            else:
                wanted_here = wanted
            if wanted_here is None:
                with pytest.raises(OffloadConfigError, match=f"invalid {option}="):
                    config(option, form)
                if isinstance(form, str):
                    with pytest.raises(UsageError, match=f"argument {FLAGS[option]}"):
                        flag(option, form)
                continue
            assert meaning(option, form) == wanted_here, (option, form)
            if isinstance(form, str):
                assert flag(option, form) == form, "the flag hands the text to the options unchanged"


@pytest.mark.parametrize("text, suggested", [
    ("24G", ("'24GiB' (24 * 2**30 bytes)", "'24GB' (24 * 10**9 bytes)")),
    ("24gb", ("'24GiB'", "'24GB'")),
    ("24Gi", ("'24GiB'", "'24GB'")),
    ("512kb", ("'512KiB'", "'512kB'")),
    ("24", ("'24GiB'", "'24GB'", "'24B' (bytes)")),
    ("1", ("'1GiB'", "'1B'", "'1.0' for all of the device's memory")),
    ("24b", ("a lower-case b is a bit", "'24B'")),
])
def test_an_ambiguous_size_names_the_unambiguous_spellings(text, suggested):
    with pytest.raises(OffloadConfigError, match=f"invalid device_memory='{text}'") as error:
        config("device_memory", text)
    for spelling in suggested:
        assert spelling in str(error.value)


def test_a_decimal_string_is_a_fraction_in_the_api_as_on_the_command_line():
    """The string "0.5" was 0 bytes in the API and half of RAM on the command line."""
    assert meaning("host_memory", "0.5") == meaning("host_memory", 0.5) == ("fraction", 0.5)
    assert flag("host_memory", "0.5") == "0.5"
    with pytest.raises(OffloadConfigError, match="'0.5' has no unit"):
        config("activation_memory", "0.5")
