"""The package's import boundaries (DESIGN.md, "Packages")."""
import subprocess
import sys

import pytest

from tests.conftest import REPO, adloader_cmd, repo_env

pytestmark = pytest.mark.component


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        env=repo_env(), cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


# A meta-path finder that makes `import torch` fail as on a node without torch.
_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, _NoTorch())
"""


def test_agent_and_client_import_without_torch():
    mods = _imported_after("import agent.cli, adloader, predictor.curve, predictor.observation, agent.model")
    assert "torch" not in mods


def test_every_agent_and_predictor_module_imports_with_torch_blocked():
    """The agent must start on a node without torch (DESIGN.md), although ``import adloader`` creates
    ``adloader.DataLoader`` eagerly in training processes: the agent package declares itself
    torch-free before importing adloader's protocol and env."""
    code = _BLOCK_TORCH + """
import importlib, pkgutil
import agent, predictor
failed = {}
for pkg in (agent, predictor):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except Exception as e:
            failed[m.name] = repr(e)
import adloader.protocol, adloader.env, adloader.client
print("FAILED", failed)
print("TORCH", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], env=repo_env(), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    failed = eval(out.stdout.split("FAILED", 1)[1].splitlines()[0])
    # evaluation code that runs training processes may need torch; the daemon's modules may not
    assert {m: e for m, e in failed.items() if ".bench" not in m} == {}
    assert "TORCH False" in out.stdout
    # and with torch installed, the agent does not import it either (start-up time, memory)
    mods = _imported_after("import agent.daemon, agent.server, agent.cli, adloader.protocol, adloader.env")
    assert "torch" not in mods


def test_dataloader_is_created_at_import_and_clear_without_torch():
    mods = _imported_after("import adloader; assert 'DataLoader' in vars(adloader)")
    assert "adloader.dataloader" in mods
    code = _BLOCK_TORCH + """
import adloader, adloader.protocol, adloader.env, adloader.client
try:
    adloader.DataLoader
except ImportError as e:
    print("ERR", e)
"""
    out = subprocess.run([sys.executable, "-c", code], env=repo_env(), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR adloader.DataLoader needs torch" in out.stdout


def test_cli_help_lists_commands():
    out = subprocess.run(adloader_cmd("--help"), env=repo_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("agent", "status", "job", "profile", "bench", "demo", "simulate"):
        assert cmd in out.stdout


@pytest.mark.parametrize("argv", [("simulate", "--list-kinds")])
def test_output_into_a_closed_pipe_ends_quietly_without_a_traceback(argv):
    """`adloader status --json | head` closes the pipe before the command is done writing: Python
    ignores SIGPIPE, so the write raised BrokenPipeError and the operator saw a traceback (and
    "Exception ignored ... BrokenPipeError" for a flush at exit). Now nothing on stderr and exit 141,
    what a shell reports for a command SIGPIPE ended. The reading end is closed before the command
    starts, so every write fails, deterministically."""
    import os

    from agent.cli import EXIT_BROKEN_PIPE

    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run(adloader_cmd(*argv), env=repo_env(), cwd=REPO, stdout=w, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    finally:
        os.close(w)
    assert out.returncode == EXIT_BROKEN_PIPE == 141 and out.stderr == "", (out.returncode, out.stderr)


def test_unknown_command_is_named():
    out = subprocess.run(adloader_cmd("frobnicate"), env=repo_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "frobnicate" in out.stderr


@pytest.mark.parametrize("argv, usage", [(("agent", "--tik-s", "1"), "adloader agent"),
                                         (("status", "extra"), "adloader status"),
                                         (("job", "release", "--gpus", "0"), "adloader job release"),
                                         (("simulate", "--node", "1", "--bogus"), "adloader simulate")])
def test_an_unknown_option_is_named_by_its_own_command(argv, usage, capsys):
    """A flag a command does not have is that command's usage error, with its usage line: it was the top
    level's ("usage: adloader [-h] [--version] COMMAND ... adloader: error: ..."), which does not say
    which command refused what (and `job release --gpus` looked like a bad top-level flag)."""
    from agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"usage: {usage} [-h]" in err and f"{usage}: error: unrecognized arguments: " in err, err
    assert "COMMAND ..." not in err


@pytest.mark.parametrize("argv", [("agent", "--config"), ("profile", "--json"), ("bench", "--catalog"),
                                  ("bench", "--out"), ("demo", "--out"), ("demo", "--catalog"),
                                  ("simulate", "--trace"), ("simulate", "--catalog"), ("simulate", "--out"),
                                  ("install-service", "--source")])
@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_path_is_a_usage_error_naming_the_flag(argv, empty, capsys):
    """``--trace "$TRACE"`` with the variable unset: '' was read as the flag not given (simulate ran its
    default 1000-node trace, bench and demo wrote into the working directory or took the packaged
    catalogue, profile wrote no JSON), without a word. Parsed only: the old code would run the command."""
    from agent.cli import build_parser

    command, flag = argv
    with pytest.raises(SystemExit) as e:
        build_parser(command).parse_args([command, flag, empty])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: an empty path" in err, err


@pytest.mark.parametrize("argv", [("bench", "--scenarios"), ("bench", "--policies"), ("simulate", "--policies"),
                                  ("demo", "--mix")])
@pytest.mark.parametrize("empty", ["", " ", ",", " , "])
def test_a_list_that_names_nothing_is_a_usage_error_naming_the_flag(argv, empty, capsys):
    """'' or ',' was read as no list (``bench --scenarios ''`` ran the default scenario) or an empty one
    (``simulate --policies ''`` printed an empty table and exited 0; ``bench --policies ''`` calibrated
    the job kinds for no run). Parsed only: the old code would run the command."""
    from agent.cli import build_parser

    command, flag = argv
    with pytest.raises(SystemExit) as e:
        build_parser(command).parse_args([command, flag, empty])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: no name given in {empty!r}" in err, err


def test_bench_quick_and_full_together_is_a_usage_error(capsys):
    """``adloader bench --quick --full`` ran the full bench (hours on a small node) without a word."""
    from agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--full"])
    assert e.value.code == 2 and "--full: not allowed with argument --quick" in capsys.readouterr().err


@pytest.mark.parametrize("argv, rc, says", [(["--help"], 0, "The GPU study"), ([], 2, "usage: evaluation/gpu_study.sh OUT"),
                                            (["--device", "emulated"], 2, "OUT first, got option --device")])
def test_the_gpu_study_script_answers_help_and_refuses_an_option_for_its_output_directory(tmp_path, argv, rc, says):
    """``evaluation/gpu_study.sh --help`` took '--help' as its output directory and started the study."""
    p = subprocess.run(["bash", str(REPO / "evaluation" / "gpu_study.sh"), *argv], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == rc and says in (p.stdout + p.stderr), (p.returncode, p.stdout, p.stderr)
    assert not any(tmp_path.iterdir())             # nothing made, nothing started


def test_framework_integrations_are_imported_only_when_used():
    mods = _imported_after("import adloader")
    assert not {"lightning", "accelerate", "transformers", "adloader.integrations"} & mods
