"""`--help` of every `batchllm` command, found by walking the click group: a command added
later is covered without touching this file."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from batchllm.cli import cli

EXPECTED = {
    "run",
    "submit",
    "worker",
    "wait",
    "cancel",
    "status",
    "jobs",
    "results",
    "reconcile",
    "bench",
    "db",
    "demo-model",
}


def walk(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every command and group under `group`, as click resolves them."""
    ctx = click.Context(group, info_name="batchllm")
    paths = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, f"{' '.join(prefix + (name,))} is listed but not found"
        paths.append(prefix + (name,))
        if isinstance(command, click.Group):
            paths += walk(command, prefix + (name,))
    return paths


COMMANDS = walk(cli)


def command_at(path: tuple[str, ...]) -> click.Command:
    command: click.Command = cli
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


def help_of(*path: str) -> str:
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="batchllm")
    assert result.exit_code == 0, result.output
    return result.output


def test_the_walk_finds_every_top_level_command_and_the_db_subcommands():
    top_level = {path[0] for path in COMMANDS}

    assert top_level >= EXPECTED
    assert ("db", "upgrade") in COMMANDS
    assert len(COMMANDS) == len(set(COMMANDS))


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_answers_help_with_a_usage_line_naming_it(path):
    output = help_of(*path)

    usage = output.splitlines()[0]
    assert usage.startswith(f"Usage: batchllm {' '.join(path)} "), usage
    options = [p for p in command_at(path).params if isinstance(p, click.Option) and not p.hidden]
    for option in options:
        assert any(flag in output for flag in option.opts), (option.name, output)


def test_the_top_level_help_lists_every_command():
    output = help_of()

    assert output.splitlines()[0].startswith("Usage: batchllm [OPTIONS] COMMAND")
    listed = output.split("Commands:", 1)[1].splitlines()
    names = {line.split()[0] for line in listed if line.strip()}
    visible = {path[0] for path in COMMANDS if len(path) == 1 and not command_at(path).hidden}
    assert names == visible
    assert names >= EXPECTED


@pytest.mark.parametrize(
    "group", [p for p in COMMANDS if isinstance(command_at(p), click.Group)], ids=" ".join
)
def test_the_help_of_every_group_lists_its_subcommands(group):
    output = help_of(*group)

    listed = output.split("Commands:", 1)[1].splitlines()
    names = {line.split()[0] for line in listed if line.strip()}
    assert names == {p[-1] for p in COMMANDS if p[:-1] == group and not command_at(p).hidden}
