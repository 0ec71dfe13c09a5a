"""Every option of every ``dflash-rs`` subcommand: a bad value is a usage error (exit status 2,
a message naming the option, no traceback) found before anything runs, and every option has
help text with its default shown."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from dflash_rs import cli, demo
from dflash_rs.bench import cli as bench_cli
from dflash_rs.sim import cli as simulate_cli
from dflash_rs.soak import cli as soak

COMMAND_MODULES = {"simulate": simulate_cli, "demo": demo, "bench": bench_cli, "soak": soak}
# Small sizes, so that a case the CLI wrongly accepts reaches the (refused) run quickly.
BENCH_TINY = ["--n-reqs", "4", "--reps", "1", "--modes", "decode", "--paths", "arrays"]
K = "--num-speculative-tokens"

BAD_CASES = [
    # bench: lists
    (["bench", "--n-reqs", "abc"], "--n-reqs"),
    (["bench", "--n-reqs", "-3"], "--n-reqs"),
    (["bench", "--n-reqs", "0"], "--n-reqs"),
    (["bench", "--n-reqs", "4,,x"], "--n-reqs"),
    (["bench", "--n-reqs", ","], "--n-reqs"),
    (["bench", "--spec", "bogus"], "--spec"),
    (["bench", "--method", "dflash,bogus"], "--spec"),
    (["bench", "--modes", "decode,bogus"], "--modes"),
    (["bench", "--paths", "tensors"], "--paths"),
    # bench: numbers
    (["bench", "-k", "0"], K),
    (["bench", "--num-spec-tokens", "65"], K),
    (["bench", "--seed", "-1"], "--seed"),
    (["bench", "--seed", "1.5"], "--seed"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--warmup-steps", "-1"], "--warmup-steps"),
    (["bench", "--measure-steps", "0"], "--measure-steps"),
    (["bench", "--max-sim-steps", "0"], "--max-sim-steps"),
    (["bench", "--block-size", "0"], "--block-size"),
    (["bench", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["bench", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["bench", "--max-model-len", "1"], "--max-model-len"),
    (["bench", "--max-tokens", "0"], "--max-tokens"),
    (["bench", "--decode-max-tokens", "0"], "--decode-max-tokens"),
    (["bench", "--prefix-len", "-1"], "--prefix-len"),
    (["bench", "--min-prompt", "0"], "--min-prompt"),
    (["bench", "--max-prompt", "0"], "--max-prompt"),
    (["bench", "--preempt-n", "-1"], "--preempt-n"),
    (["bench", "--preempt-block-frac", "0"], "--preempt-block-frac"),
    (["bench", "--preempt-block-frac", "nan"], "--preempt-block-frac"),
    (["bench", "--micro-iters", "0"], "--micro-iters"),
    (["bench", "--micro-prompt-len", "0"], "--micro-prompt-len"),
    (["bench", "--micro-seed", "-1"], "--micro-seed"),
    (["bench", "--baseline-timeout", "0"], "--baseline-timeout"),
    (["bench", "--baseline-timeout", "inf"], "--baseline-timeout"),
    (["bench", "--dump-prompt-hashes", "-1"], "--dump-prompt-hashes"),
    (["bench", "--accept", "some"], "--accept"),
    (["bench", "--hash-algo", "md5"], "--hash-algo"),
    (["bench", "--perf-ctl", "only-one-fifo"], "--perf-ctl"),
    # bench: output paths
    (["bench", "--json", "{dir}"], "--json"),
    (["bench", "--json", "{under_file}"], "--json"),
    (["bench", "--trace-out", "{dir}"], "--trace-out"),
    (["bench", "--profile-out", "{under_file}"], "--profile-out"),
    # bench: options checked against each other
    (["bench", "--min-prompt", "3000"], "--min-prompt"),
    (["bench", "--max-model-len", "1000"], "--max-model-len"),
    (["bench", "--modes", "micro", "--micro-prompt-len", "10000"], "--micro-prompt-len"),
    # demo
    (["demo", "-k", "-5"], K),
    (["demo", "--num-blocks", "0"], "--num-blocks"),
    (["demo", "--num-blocks", "1"], "--num-blocks"),
    (["demo", "--num-blocks", "x"], "--num-blocks"),
    (["demo", "--block-size", "0"], "--block-size"),
    (["demo", "--block-size", "2000"], "--block-size"),
    (["demo", "--num-requests", "-1"], "--num-requests"),
    (["demo", "--seed", "-1"], "--seed"),
    # simulate
    (["simulate", "--json", "{dir}"], "--json"),
    (["simulate", "--json", "{under_file}"], "--json"),
    (["simulate", "--plot", "{dir}"], "--plot"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--num-requests", "0"], "--num-requests"),
    (["simulate", "--num-blocks", "1"], "--num-blocks"),
    (["simulate", "--block-size", "0"], "--block-size"),
    (["simulate", "--method", "bogus"], "--method"),
    (["simulate", "-k", "0"], K),
    (["simulate", "--acceptance-rate", "1.5"], "--acceptance-rate"),
    (["simulate", "--acceptance-rate", "nan"], "--acceptance-rate"),
    (["simulate", "--arrival-rate", "-1"], "--arrival-rate"),
    (["simulate", "--max-model-len", "1"], "--max-model-len"),
    (["simulate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["simulate", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["simulate", "--policy", "lifo"], "--policy"),
    (["simulate", "--kernel", "cuda"], "--kernel"),
    (["simulate", "--lookahead-policy", "bogus"], "--lookahead-policy"),
    (["simulate", "--max-steps", "0"], "--max-steps"),
    (["simulate", "--num-blocks", "10"], "--num-blocks"),  # cannot hold max_model_len
    # soak
    (["soak", "--num-requests", "0"], "--num-requests"),
    (["soak", "--num-blocks", "1"], "--num-blocks"),
    (["soak", "--block-size", "0"], "--block-size"),
    (["soak", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["soak", "--method", "bogus"], "--method"),
    (["soak", "-k", "0"], K),
    (["soak", "--policy", "lifo"], "--policy"),
    (["soak", "--seed", "-1"], "--seed"),
    (["soak", "--abort-rate", "2"], "--abort-rate"),
    (["soak", "--check-every", "0"], "--check-every"),
    (["soak", "--max-rss-growth", "-1"], "--max-rss-growth"),
    (["soak", "--json", "{dir}"], "--json"),
    (["soak", "--num-blocks", "4"], "--num-blocks"),  # cannot hold one request
]


@pytest.fixture
def refuse_runs(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Replace each subcommand's run: a test sees whether the CLI got that far."""
    ran: List[str] = []
    for name, module in COMMAND_MODULES.items():
        monkeypatch.setattr(module, "run", lambda args, name=name: ran.append(name) or 0)
    return ran


def _expand(argv: Sequence[str], tmp_path: Path) -> List[str]:
    regular_file = tmp_path / "file.txt"
    regular_file.write_text("")
    places = {"{dir}": str(tmp_path), "{under_file}": str(regular_file / "out.json")}
    argv = [places.get(a, a) for a in argv]
    return [argv[0], *BENCH_TINY, *argv[1:]] if argv[0] == "bench" else argv


@pytest.mark.parametrize(("argv", "option"), BAD_CASES, ids=[" ".join(c[0]) for c in BAD_CASES])
def test_bad_value_is_a_usage_error(
    argv: List[str],
    option: str,
    tmp_path: Path,
    refuse_runs: List[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(_expand(argv, tmp_path))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert refuse_runs == []
    assert f"usage: dflash-rs {argv[0]}" in err and "error:" in err
    assert option in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--n-reqs", "abc"],
        ["simulate", "--json", "{dir}"],
        ["demo", "--num-blocks", "0"],
    ],
)
def test_usage_error_in_a_subprocess_has_no_traceback(argv: List[str], tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dflash_rs", *_expand(argv, tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "usage: dflash-rs" in done.stderr and "Traceback" not in done.stderr


def test_limits_are_accepted(
    tmp_path: Path, refuse_runs: List[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The smallest accepted values, and report paths in folders that do not exist yet."""
    new_folder = tmp_path / "new" / "r.json"
    argv = ["bench", "--n-reqs", "1,2", "--spec", "none,dflash", "-k", "64", "--reps", "1"]
    argv += ["--warmup-steps", "0", "--prefix-len", "0", "--min-prompt", "1", "--max-prompt", "1"]
    argv += ["--preempt-n", "0", "--seed", "0", "--max-model-len", "16", "--micro-prompt-len", "16"]
    argv += ["--json", str(new_folder), "--perf-ctl", "ctl,ack"]
    assert cli.main(argv) == 0
    assert cli.main(["demo", "--num-blocks", "2", "--block-size", "1", "-k", "1"]) == 0
    assert cli.main(["simulate", "--acceptance-rate", "0", "--json", str(new_folder)]) == 0
    assert (
        cli.main(["soak", "--abort-rate", "1", "--max-rss-growth", "0", "--check-every", "1"]) == 0
    )
    assert refuse_runs == ["bench", "demo", "simulate", "soak"]
    assert not new_folder.parent.exists()  # checked, not created, before the run


def test_bench_lists_are_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: List[argparse.Namespace] = []
    monkeypatch.setattr(bench_cli, "run", lambda args: seen.append(args) or 0)
    assert cli.main(["bench", "--n-reqs", "8,4", "--modes", "serve"]) == 0
    assert cli.main(["bench"]) == 0
    assert (seen[0].n_reqs, seen[0].modes, seen[0].spec) == ([8, 4], ["serve"], ["dflash"])
    assert seen[1].n_reqs == [64, 256, 1024] and seen[1].paths == ["arrays", "lists"]


def test_bench_wrapper_gives_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """``benches/scheduler_bench.py`` (bench's own main) checks its arguments the same way."""
    with pytest.raises(SystemExit) as exc:
        bench_cli.main([*BENCH_TINY, "--min-prompt", "3000"])
    assert exc.value.code == 2
    assert "--min-prompt" in capsys.readouterr().err


def _subparsers() -> Dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_is_covered() -> None:
    assert set(_subparsers()) == set(COMMAND_MODULES)
    covered = {argv[0] for argv, _ in BAD_CASES}
    assert covered == set(COMMAND_MODULES)


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = _subparsers()[command]
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    missing = [a.option_strings for a in options if not (a.help or "").strip()]
    assert missing == [], f"{command}: options without help text"
    shown = parser.format_help()
    for action in options:
        if action.help is not argparse.SUPPRESS:
            assert max(action.option_strings, key=len) in shown


def test_keyboard_interrupt_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: argparse.Namespace) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate_cli, "config_from_args", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["simulate"])
