"""The leasehold command line: it works on the example and fails loudly on bad input."""

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
