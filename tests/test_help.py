"""Every subcommand's --help answers: each option's default and choices are shown, the
recipes come with their data, and no help text carries markup characters."""

from __future__ import annotations

import argparse
import re

import pytest

from pockengine.cli import build_parser, main
from pockengine.cli_help import BACKEND_CHOICES, RECIPE_DATA
from pockengine.sparse.schemes import SCHEME_NAMES

MARKUP = ("`", "*")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


def flat(text: str) -> str:
    """Help text with its line wrapping undone."""
    return re.sub(r"\s+", " ", text)


def shown_default(default: object) -> list[set[str]]:
    """Each value of a default, in the forms help may write it (0.0 as 0.0 or 0)."""
    values = default if isinstance(default, list | tuple) else [default]
    return [{str(v), f"{v:g}"} if isinstance(v, float) else {str(v)} for v in values]


COMMANDS = sorted(subparsers())


def test_every_known_subcommand_is_walked() -> None:
    assert {"demo", "inspect", "finetune", "search", "export", "federated", "plot"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_option_shows_its_default_and_choices(command: str) -> None:
    sub = subparsers()[command]
    text = flat(sub.format_help())
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1]
        flag = action.nargs == 0 and isinstance(action.default, bool)
        if not flag and action.default not in (None, argparse.SUPPRESS):
            own = flat(formatter._format_action(action))
            assert "default" in own, f"{command} {name}: {own!r}"
            if action.dest != "layers":  # its default, every layer, is the glob *
                for forms in shown_default(action.default):
                    assert any(f in own for f in forms), f"{command} {name}: {forms} not in {own!r}"
        for choice in action.choices or ():
            assert str(choice) in text, f"{command} {name}: choice {choice!r} not shown"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_markup_in_help(command: str) -> None:
    text = subparsers()[command].format_help()
    for mark in MARKUP:
        assert mark not in text, f"{command} --help holds {mark!r}"


def test_top_level_help_has_no_markup() -> None:
    text = build_parser().format_help()
    assert not any(mark in text for mark in MARKUP)


def test_finetune_help_lists_backends_schemes_recipes_and_threads() -> None:
    text = flat(subparsers()["finetune"].format_help())
    for backend in BACKEND_CHOICES:
        assert backend in text
    for scheme in SCHEME_NAMES:
        assert scheme in text
    assert "scheme file" in text and "--threads" in text and "--report" in text
    for recipe, data in RECIPE_DATA.items():
        assert f"{recipe}, {data}" in text


def test_recipe_help_names_every_recipe() -> None:
    from pockengine.tasks.recipes import RECIPES

    assert set(RECIPE_DATA) == set(RECIPES)


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["finetune", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: adamw)" in flat(out) and "(default: torch)" in flat(out)
