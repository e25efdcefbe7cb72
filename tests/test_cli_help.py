"""Every flag of every `python -m lrmq.*` command has help text, and --help-config lists the fields of a
list of dataclasses (a study's `arms`). The parsers are caught as `--help` prints them: nothing runs."""

from __future__ import annotations

import argparse
import importlib

import pytest

# (module, argv that reaches its parser's --help): the flag form, the config form and --compile-only of lrmq.quantize
COMMANDS = [("lrmq.train", []), ("lrmq.generate", []), ("lrmq.convert", []), ("lrmq.quantize", []),
            ("lrmq.quantize", ["--config", "x.yaml"]), ("lrmq.quantize", ["--compile-only"]),
            ("lrmq.perplexity", []), ("lrmq.evaluate", []),
            ("lrmq.study", []), ("lrmq.data.synthetic", []), ("lrmq.ptq.pseudo_ft", []),
            ("lrmq.studies.heldout", [])]


def _parser_of(monkeypatch, module: str, argv: list[str]) -> argparse.ArgumentParser:
    seen = []

    def catch(self, file=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", catch)
    mod = importlib.import_module(module)
    entry = mod.main if hasattr(mod, "main") else mod.parse_args
    with pytest.raises(SystemExit):
        entry([*argv, "--help"])
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("module,argv", COMMANDS, ids=[m + (f" {a[0]}" if a else "") for m, a in COMMANDS])
def test_every_flag_has_help(monkeypatch, module, argv):
    parser = _parser_of(monkeypatch, module, argv)
    empty = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
             if not (a.help or "").strip() and a.help is not argparse.SUPPRESS]
    assert not empty, f"python -m {module}: flags without help text: {empty}"


def test_help_config_lists_the_fields_of_list_items():
    from lrmq.config_help import describe_type, iter_options, options_help
    from lrmq.studies.config import ArmSpec, StudyConfig

    text = options_help(StudyConfig)
    assert "\narms (list[ArmSpec]) = []\n" in text
    for key, _, _ in iter_options(ArmSpec):
        assert f"  arms[].{key} (" in text, key
    assert "  arms[].method (str) = ''\n      ptq: the PTQ method\n      known ptq method names: awq," in text
    assert describe_type(dict[str, list[str]]) == "dict[str, list[str]]"
    assert describe_type(tuple[int, ...]) == "tuple[int, ...]"
