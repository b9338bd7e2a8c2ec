"""The leasehold command line: it works on the example and fails loudly on bad input."""

import pytest

import engine.cli
from engine.cli import main


def test_check_config_summarises_the_example(capsys):
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert ": ok" in out
    assert "queue gpu: priority 700, STRICT_FIFO" in out


def test_check_config_names_file_key_and_value_of_a_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('resources = ["cpu"]\n[clusters.a]\n[queues.q]\npriority = "HIGH"\n')
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leasehold: INVALID_CONFIG: ")
    assert f"{bad}: queues.q.priority: 'HIGH' is invalid" in err
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err


def test_demo_runs_the_real_tick_and_explains_the_waits(capsys):
    assert main(["demo", "--ticks", "1"]) == 0
    out = capsys.readouterr().out
    assert "tick 1: " in out and " assigned" in out
    assert "WAITING_FOR_RESOURCES: queue gpu:" in out
    assert "0 refused" in out and "refused ['ABORTED', 'COMPLETED'] x2" in out
    assert "[finalize] -> cpu-pool/worker-cpu-pool (generation 1)" in out
    assert "etl0/step0 attempt 1: cluster cpu-pool, worker worker-cpu-pool, FAILED OOM" in out


@pytest.mark.parametrize("exc, code, status", [
    (RuntimeError("boom"), "INTERNAL: RuntimeError: boom (a bug", 2),
    (FileNotFoundError(2, "No such file or directory", "/x"), "UNAVAILABLE: ", 2),
    (KeyboardInterrupt(), "INTERRUPTED: stopped (Ctrl-C)", 130),
])
def test_every_command_fails_in_one_line_without_a_traceback(monkeypatch, capsys, exc, code,
                                                            status):
    # The commands of engine/cli.py (check-config, simulate, shard, serve, keys, ...) go
    # through the same guard as the user commands: no traceback reaches the user.
    def fail(args):
        raise exc
    monkeypatch.delenv("LEASEHOLD_TRACEBACK", raising=False)
    monkeypatch.setattr(engine.cli, "_check_config", fail)
    assert main(["check-config"]) == status
    err = capsys.readouterr().err
    assert err.startswith(f"leasehold: {code}") and err.count("\n") == 1, err
