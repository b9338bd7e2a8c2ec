"""The simulator: hand-made traces through the real tick on a virtual clock, answers known."""

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

from engine._config import GREEDY_CAPACITY, STRICT_FIFO, parse_config
from engine._errors import SpecError
from engine._sim import policy_config, prepare, simulate
from engine._trace import Job, TraceError
from engine.cli import main

ROOT = Path(__file__).resolve().parent.parent

GPU8 = {"cpu": 8, "gpu:H100": 8}


def _config(**queue):
    return parse_config({
        "resources": ["cpu", "gpu:H100"],
        "engine": {"default_queue": "q"},
        "clusters": {"a": {"node_shapes": [
            {"name": "n", "count": 2, "allocatable": {"cpu": 8, "gpu:H100": 4}}]}},
        "queues": {"q": queue, "other": {"clusters": ["a"]}},
    }, source="<test>")


def _job(i, submit, runtime, *pods, queue=None, task="t"):
    return Job(id=str(i), submit=submit, runtime=runtime, pods=tuple(pods), task=task,
               queue=queue, where=f"test:{i}")




def test_second_job_waits_exactly_the_first_ones_runtime():
    cfg = _config()
    jobs = [_job(0, 0, 100, (2, {"cpu": 4, "gpu:H100": 4})),
            _job(1, 0, 50, (2, {"cpu": 4, "gpu:H100": 4}))]
    for policy in ("fifo", "greedy"):
        r = simulate(cfg, jobs, policy, series=True)
        assert r.completed == 2 and r.rejected == 0 and r.unfinished == 0
        assert r.mean_wait_s == 50.0                    # waits 0 and 100
        assert r.gang_max_wait_s == 100.0 and r.gangs == 2
        assert r.makespan_s == 150.0
        # bounded slowdown: (0 + 100)/100 = 1 and (100 + 50)/50 = 3
        assert r.bounded_slowdown == 2.0
        assert r.series["t_s"] == [0.0, 100.0, 150.0]
        assert r.series["queued"] == [1, 0, 0]
        assert r.series["utilization"] == [1.0, 1.0, 0.0]


def test_fifo_holds_small_work_behind_a_gang_and_greedy_lets_it_pass():
    cfg = _config()
    jobs = [
        _job(0, 0, 100, (1, {"cpu": 4, "gpu:H100": 4})),     # half the GPUs
        _job(1, 1, 100, (2, {"cpu": 4, "gpu:H100": 4})),     # a gang of all 8
        _job(2, 2, 100, (1, {"cpu": 4, "gpu:H100": 4})),     # fits now, behind the gang
    ]
    fifo = simulate(cfg, jobs, "fifo")
    greedy = simulate(cfg, jobs, "greedy")
    # fifo: the gang starts when job 0 ends (t=100), job 2 after the gang (t=200).
    assert fifo.gang_max_wait_s == 99.0
    assert fifo.mean_wait_s == pytest.approx((0 + 99 + 198) / 3)
    assert fifo.makespan_s == 300.0
    # greedy: job 2 starts at once; the gang waits for both (t=102).
    assert greedy.gang_max_wait_s == 101.0
    assert greedy.mean_wait_s == pytest.approx((0 + 101 + 0) / 3)
    assert greedy.makespan_s == 202.0
    # bounded slowdown: fifo (1 + 199/100 + 298/100)/3, greedy (1 + 201/100 + 1)/3
    assert fifo.bounded_slowdown == pytest.approx((1 + 1.99 + 2.98) / 3)
    assert greedy.bounded_slowdown == pytest.approx((1 + 2.01 + 1) / 3)


def test_utilisation_is_gpu_seconds_over_capacity_between_first_and_last_submission():
    cfg = _config()
    jobs = [
        _job(0, 0, 50, (1, {"cpu": 1, "gpu:H100": 4})),     # 4 GPUs x 50 s
        _job(1, 20, 1000, (1, {"cpu": 8})),                  # no GPU: not counted
        _job(2, 60, 80, (1, {"cpu": 1, "gpu:H100": 2})),     # 2 GPUs x 40 s inside the window
        _job(3, 100, 10, (1, {"cpu": 1, "gpu:H100": 4})),    # starts at the window's end
    ]
    r = simulate(cfg, jobs, "fifo")
    assert r.resource == "gpu"
    assert r.utilization == pytest.approx((4 * 50 + 2 * 40) / (8 * 100))
    cpu = simulate(cfg, jobs, "fifo", resource="cpu")
    # cpu millicores: 1 x 50 + 8 x 80 + 1 x 40, over 16 cpu x 100 s
    assert cpu.resource == "cpu"
    assert cpu.utilization == pytest.approx((1 * 50 + 8 * 80 + 1 * 40) / (16 * 100))
    with pytest.raises(SpecError, match="resource 'gpu' is not configured"):
        simulate(cfg, jobs, "fifo", resource="gpu")


def test_short_jobs_are_bounded_at_ten_seconds_and_single_pods_are_not_gangs():
    cfg = _config()
    jobs = [_job(0, 0, 15, (2, {"cpu": 8, "gpu:H100": 4})),
            _job(1, 0, 5, (1, {"cpu": 1}))]                  # waits 15 s, runs 5 s
    r = simulate(cfg, jobs, "fifo")
    assert r.bounded_slowdown == pytest.approx((1 + (15 + 5) / 10) / 2)
    assert r.gangs == 1 and r.gang_max_wait_s == 0.0
    solo = simulate(cfg, [jobs[1]], "fifo")
    assert solo.gang_max_wait_s is None and solo.gangs == 0
    assert solo.utilization is None      # one submission: an empty window


def test_a_queue_at_its_depth_rejects_jobs_and_they_are_counted():
    cfg = _config(depth=1)
    jobs = [_job(i, 0, 10, (2, {"cpu": 8, "gpu:H100": 4})) for i in range(4)]
    r = simulate(cfg, jobs, "fifo")
    # Enqueued at once: the batch passes the depth, so each is tried alone: one is queued
    # (the tick runs after the whole batch), the rest are refused.
    assert r.rejected == 3 and r.completed == 1 and r.unfinished == 0


def test_policies_rewrite_every_queue():
    cfg = _config(scheduling="GREEDY_CAPACITY")
    fifo = policy_config(cfg, "fifo")
    assert {q.scheduling for q in fifo.queues} == {STRICT_FIFO}
    assert {q.scheduling for q in policy_config(cfg, "greedy").queues} == {GREEDY_CAPACITY}
    assert fifo.engine.heartbeat_interval > 1e7       # leases never expire between events
    assert cfg.queue("q").scheduling == GREEDY_CAPACITY   # the given config is untouched
    bf = policy_config(cfg, "backfill")
    assert {(q.scheduling, q.backfill) for q in bf.queues} == {(STRICT_FIFO, True)}
    assert {q.backfill for q in fifo.queues} == {False}
    with pytest.raises(SpecError, match="unknown policy 'lifo'"):
        policy_config(cfg, "lifo")


def test_jobs_are_checked_against_the_config():
    cfg = _config(max_accelerators={"gpu:H100": 4})
    with pytest.raises(TraceError, match=r"test:0: job 0: run_queue 'nope' does not exist"):
        prepare(cfg, [_job(0, 0, 1, (1, {"cpu": 1}), queue="nope")])
    with pytest.raises(TraceError, match=r"test:0: job 0: .*unknown resource 'gpu:A100'"):
        prepare(cfg, [_job(0, 0, 1, (1, {"gpu:A100": 1}))])
    with pytest.raises(TraceError, match=r"test:0: job 0 can never run: it needs gpu:H100=8, "
                                         r"more than queue q's max_resources 4"):
        prepare(cfg, [_job(0, 0, 1, (2, {"gpu:H100": 4}))])
    with pytest.raises(TraceError, match=r"test:1: job 1 can never run: a pod "
                                         r"\(cpu=8, gpu:H100=8\) fits no node shape of cluster a"):
        prepare(cfg, [_job(0, 0, 1, (1, {"cpu": 1})),
                      _job(1, 0, 1, (1, GPU8), queue="other")])
    with pytest.raises(TraceError, match=r"cluster a has cpu=16 in all, it needs 32"):
        prepare(cfg, [_job(0, 0, 1, (4, {"cpu": 8}))])
    kept = prepare(cfg, [_job(0, 0, 1, (1, {"cpu": 1})), _job(1, 0, 1, (4, {"cpu": 8}))],
                   skip_unfit=True)
    assert [j.id for j in kept.jobs] == ["0"] and len(kept.unfit) == 1
    r = simulate(cfg, [_job(0, 0, 1, (1, {"cpu": 1})), _job(1, 0, 1, (4, {"cpu": 8}))],
                 "greedy", skip_unfit=True)
    assert r.jobs == 1 and r.completed == 1


def test_unknown_capacity_leaves_utilisation_undefined():
    cfg = parse_config({"resources": ["cpu"], "clusters": {"open": {}}}, source="<t>")
    jobs = [_job(0, 0, 10, (1, {"cpu": 1})), _job(1, 5, 10, (3, {"cpu": 1000}))]
    r = simulate(cfg, jobs, "fifo")
    assert r.utilization is None and r.completed == 2 and r.mean_wait_s == 0.0


# ---------------------------------------------------------------------------------------------
# The command line


# The small traces below use the queues of the general example config.
EXAMPLE = ["--config", str(ROOT / "engine/examples/leasehold.toml")]


def _trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"submit": 0, "runtime": 100, "queue": "gpu", "task": "solo",
         "resources": {"cpu": 4, "gpu:H100": 8}},
        {"submit": 1, "runtime": 100, "queue": "gpu", "task": "gang",
         "pods": [{"count": 3, "resources": {"cpu": 8, "memory": "64Gi", "gpu:H100": 8}}]},
        {"submit": 2, "runtime": 50, "queue": "gpu", "resources": {"gpu": "H100:8"}},
        {"submit": 3, "runtime": 20, "queue": "batch", "resources": {"cpu": 2}},
        {"submit": 4, "runtime": 5, "resources": {"cpu": 1, "memory": "1Gi"}},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_cli_prints_a_table_per_policy(tmp_path, capsys):
    path = _trace_file(tmp_path)
    assert main(["simulate", str(path), *EXAMPLE]) == 0
    out = capsys.readouterr().out
    assert "5 jobs (1 gangs)" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    for col in ("utilisation", "mean wait", "p95 wait", "bounded slowdown", "gang max wait",
                "backfilled", "jobs"):
        assert col in header
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "5/5" in rows["fifo"] and "5/5" in rows["greedy"] and "5/5" in rows["backfill"]


def test_cli_json_and_policy_choice(tmp_path, capsys):
    path = _trace_file(tmp_path)
    assert main(["simulate", str(path), *EXAMPLE, "--policy", "fifo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["policies"]) == ["fifo"] and data["jobs"] == 5 and data["gangs"] == 1
    fifo = data["policies"]["fifo"]
    assert fifo["completed"] == 5 and fifo["resource"] == "gpu"
    assert fifo["gang_max_wait_s"] == 99.0        # the 24-GPU gang waits for the solo job
    assert main(["simulate", str(path), *EXAMPLE, "--policy", "fifo,lifo"]) == 2
    assert "unknown lifo; allowed: fifo, backfill, greedy" in capsys.readouterr().err


def test_cli_writes_a_png_plot(tmp_path, capsys):
    path = _trace_file(tmp_path)
    png = tmp_path / "out.png"
    assert main(["simulate", str(path), *EXAMPLE, "--policy", "fifo,greedy",
                 "--plot", str(png)]) == 0
    assert f"plot: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = _trace_file(tmp_path)
    assert main(["simulate", str(path), *EXAMPLE, "--policy", "fifo", "--plot",
                 str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib: install it with `pip install matplotlib`" in (
        capsys.readouterr().err)


def test_cli_runs_an_swf_trace_with_a_processor_mapping(tmp_path, capsys):
    swf = tmp_path / "w.swf"
    swf.write_text("; SWF\n1 0 0 100 16 -1 -1 16 -1 -1 1 1 1 1 1 -1 -1 -1\n"
                   "2 10 0 100 -1 -1 -1 -1 -1 -1 1 1 1 1 1 -1 -1 -1\n"
                   "3 20 0 30 8 -1 -1 8 -1 -1 1 1 1 2 1 -1 -1 -1\n")
    assert main(["simulate", str(swf), *EXAMPLE, "--swf-resource", "cpu", "--swf-per-proc", "500m",
                 "--swf-queue", "batch", "--policy", "fifo"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs (2 gangs)" in out and "skipped 1 SWF jobs (1 no processor count (-1))" in out
    assert main(["simulate", str(swf), *EXAMPLE, "--swf-queue", "nope"]) == 2
    assert "--swf-queue 'nope': not a queue of " in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--swf-per-proc", "x"], "--swf-per-proc 'x': cpu: 'x' is not a quantity"),
    (["--swf-per-proc", "-1"], "--swf-per-proc '-1': cpu: -1 is negative"),
    (["--swf-per-proc", "0"], "--swf-per-proc '0': a quantity > 0 of cpu per processor"),
    (["--swf-resource", "memory", "--swf-per-proc", "0Gi"],
     "--swf-per-proc '0Gi': a quantity > 0 of memory per processor"),
    (["--swf-resource", "nope"], "--swf-resource 'nope': not a resource of "),
    (["--swf-queue", "nope"], "--swf-queue 'nope': not a queue of "),
])
def test_cli_names_a_bad_swf_flag_not_the_trace(tmp_path, capsys, flags, message):
    # The flag was wrong, not the file: it used to be blamed on the first SWF line, and a
    # zero per processor ran jobs asking for nothing.
    swf = tmp_path / "w.swf"
    swf.write_text("1 0 0 100 16 -1 -1 16 -1 -1 1 1 1 1 1 -1 -1 -1\n")
    assert main(["simulate", str(swf), *EXAMPLE, *flags]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"leasehold: INVALID_ARGUMENT: {message}"), err
    assert "w.swf" not in err and out == ""


def test_cli_unfit_job_is_an_error_unless_skipped(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"submit": 0, "runtime": 1, "queue": "gpu", "resources": {"gpu:H100": 9}}\n'
                    '{"submit": 1, "runtime": 1, "resources": {"cpu": 1}}\n')
    assert main(["simulate", str(path), *EXAMPLE]) == 2
    assert "t.jsonl:1: job 1 can never run: " in capsys.readouterr().err
    assert main(["simulate", str(path), *EXAMPLE, "--skip-unfit", "--policy", "greedy"]) == 0
    assert "dropped 1 jobs that can never run (first: " in capsys.readouterr().out


@pytest.mark.parametrize(("name", "text", "extra", "why"), [
    ("empty.jsonl", "", [], " is empty: no actions"),
    ("empty.swf", "\n", [], " is empty: no actions"),
    ("comments.jsonl", "# a header\n\n# and nothing else\n", [],
     ": holds no jobs (only # comments and blank lines)"),
    ("header.swf", "; Version: 2.2\n; MaxJobs: 0\n", [],
     ": holds no jobs (only ; comments and blank lines)"),
    ("header.txt", "; Version: 2.2\n", ["--format", "swf"],
     ": holds no jobs (only ; comments and blank lines)"),
    ("skipped.swf", "; SWF\n1 0 0 -1 4 -1 -1 4 -1 -1 1 1 1 1 1 -1 -1 -1\n"
     "2 5 0 100 -1 -1 -1 -1 -1 -1 1 1 1 1 1 -1 -1 -1\n", [],
     ": holds no jobs to simulate: all 2 SWF jobs were skipped (1 no processor count (-1), "
     "1 no run time (-1))"),
])
def test_cli_refuses_a_trace_without_jobs(tmp_path, capsys, name, text, extra, why):
    # Every format simulate reads: an empty trace is bad input (exit 2, the file named), not
    # a table of zeros with exit 0; nothing is written (no plot either).
    path = tmp_path / name
    path.write_text(text)
    png = tmp_path / "out.png"
    assert main(["simulate", str(path), *EXAMPLE, *extra, "--plot", str(png)]) == 2
    out, err = capsys.readouterr()
    assert err == f"leasehold: INVALID_TRACE: {path}{why}\n"
    assert out == "" and not png.exists()
    assert main(["simulate", str(path), *EXAMPLE, *extra, "--json"]) == 2
    assert capsys.readouterr().out == ""


def test_cli_refuses_when_skip_unfit_drops_every_job(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"submit": 0, "runtime": 1, "queue": "gpu", "resources": {"gpu:H100": 9}}\n'
                    '{"submit": 1, "runtime": 1, "queue": "gpu", "resources": {"gpu:H100": 9}}\n')
    assert main(["simulate", str(path), *EXAMPLE, "--skip-unfit"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"leasehold: INVALID_TRACE: {path}: none of its 2 jobs can ever run "
                          f"on ")
    assert f"(--skip-unfit dropped them all; first: {path}:1: " in err
    assert out == ""


def test_cli_refuses_a_policy_given_twice(tmp_path, capsys):
    path = _trace_file(tmp_path)
    assert main(["simulate", str(path), *EXAMPLE, "--policy", "fifo,greedy,fifo"]) == 2
    out, err = capsys.readouterr()
    assert err == "leasehold: INVALID_ARGUMENT: --policy 'fifo,greedy,fifo': fifo given twice\n"
    assert out == ""


def test_the_bundled_example_trace_shows_the_policies_apart(capsys):
    assert main(["simulate", str(ROOT / "engine/examples/trace.jsonl"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fifo, greedy = data["policies"]["fifo"], data["policies"]["greedy"]
    backfill = data["policies"]["backfill"]
    assert data["jobs"] > 500 and data["gangs"] > 20
    assert fifo["completed"] == greedy["completed"] == backfill["completed"] == data["jobs"]
    # Backfill runs work in the gaps a blocked gang leaves: far shorter waits than plain
    # STRICT_FIFO, at no cost in utilisation.
    assert backfill["backfilled"] > 100
    assert backfill["mean_wait_s"] * 5 < fifo["mean_wait_s"]
    assert backfill["utilization"] >= fifo["utilization"]
    assert fifo["mean_wait_s"] > 2 * greedy["mean_wait_s"]


def test_quality_bench_with_node_admission_prints_one_json_object(capsys):
    """bench/quality.py --admission nodes: every cluster places pods in the engine, backfill
    reserves nodes, and every job of the trace completes under every policy."""
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "bench/quality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--days", "0.1", "--admission", "nodes"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["admission"] == "nodes" and data["jobs"] > 20
    for policy in ("fifo", "backfill", "greedy", "backfill_exact"):
        assert data[f"completed_{policy}"] == data["jobs"], policy
        assert isinstance(data[f"mean_wait_{policy}_s"], float), policy


def test_quality_bench_oracle_laws_are_the_models_own(capsys):
    """--oracle: the estimates come from each job's true runtime law, whose mean and
    quantiles match the model's draws, and each oracle run is printed against exact."""
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "bench/quality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = random.Random(7)
    for law in ((600.0, 0.2), (3600.0, 1.2), (4 * 3600.0, 1.2)):   # the last one hits the cap
        draws = sorted(min(bench.CAP_S, max(1.0, law[0] * rng.lognormvariate(0.0, law[1])))
                       for _ in range(200_000))
        assert bench.law_mean(law) == pytest.approx(sum(draws) / len(draws), rel=0.01)
        assert bench.law_quantile(law, 0.8) == pytest.approx(draws[160_000], rel=0.02)
    laws = []
    jobs = bench.generate(3, 0.1, laws)
    assert len(laws) == len(jobs) and jobs == bench.generate(3, 0.1)
    # Each job's recorded law is the one its runtime was drawn from: standardised, the logs
    # of the runtimes the cap and the floor left alone are a standard normal sample.
    laws = []
    jobs = bench.generate(1, 2.0, laws)
    z = [math.log(j.runtime / scale) / sigma
         for j, (scale, sigma) in zip(jobs, laws, strict=True) if 1.0 < j.runtime < bench.CAP_S]
    mean = sum(z) / len(z)
    sd = math.sqrt(sum((x - mean) ** 2 for x in z) / len(z))
    assert len(z) > 500 and abs(mean) < 0.15 and 0.85 < sd < 1.15
    assert bench.main(["--days", "0.5", "--seed", "1", "--oracle"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mean_wait_backfill_exact_s"] > 0      # (a trace with contention)
    for law in bench.ORACLES:
        assert isinstance(data[f"mean_wait_oracle_{law}_s"], float), law
        assert data[f"oracle_{law}_vs_exact_mean_wait"] == pytest.approx(
            data[f"mean_wait_oracle_{law}_s"] / data["mean_wait_backfill_exact_s"], abs=0.01)
    assert data["oracle_best_vs_exact_mean_wait"] == min(
        data[f"oracle_{law}_vs_exact_mean_wait"] for law in bench.ORACLES)


def test_backfill_bench_prints_one_json_object(capsys):
    spec = importlib.util.spec_from_file_location("bench_backfill", ROOT / "bench/backfill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--days", "0.5", "--seed", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seed"] == 3 and data["jobs"] > 50
    for policy in ("fifo", "backfill", "greedy"):
        for key in (f"utilization_{policy}", f"mean_wait_{policy}_s",
                    f"bounded_slowdown_{policy}", f"gang_max_wait_{policy}_s"):
            assert isinstance(data[key], float), key
    assert isinstance(data["goal_mean_wait_cut_10x"], bool)
    assert data["nodes"] is True and isinstance(data["pended_fifo"], int)
    assert bench.main(["--days", "0.25", "--seed", "3", "--no-nodes"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert flat["nodes"] is False and flat["pended_fifo"] is None
    again = bench.generate(3, 0.5)
    assert [(j.submit, j.runtime, j.task) for j in again] == [
        (j.submit, j.runtime, j.task) for j in bench.generate(3, 0.5)]


def test_an_instant_cut_short_by_the_candidate_budget_is_ticked_again():
    # Two candidates a tick. At t=1 the two GPU jobs examined first do not fit (job 0 holds
    # every GPU until t=100) and the tick stops at its candidate budget having placed nothing;
    # the CPU job it did not reach fits, and starts at t=1, not at the next event (t=100).
    cfg = parse_config({
        "resources": ["cpu", "gpu:H100"],
        "engine": {"default_queue": "q", "max_candidates": 2},
        "clusters": {"a": {"capacity": {"cpu": 16, "gpu:H100": 8}}},
        "queues": {"q": {}},
    }, source="<test>")
    gpu = {"cpu": 1, "gpu:H100": 8}
    jobs = [_job(0, 0, 100, (1, gpu), task="a"), _job(1, 1, 10, (1, gpu), task="b"),
            _job(2, 1, 10, (1, gpu), task="c"), _job(3, 1, 10, (1, {"cpu": 1}), task="d")]
    r = simulate(cfg, jobs, "greedy", series=True)
    assert r.completed == 4
    assert r.series["t_s"][:3] == [0.0, 1.0, 11.0]     # job 3 ran from 1 to 11
    assert r.series["queued"][1] == 2                   # only the GPU jobs still queued at 1
    # Waits: 0, 99 and 109 (the GPU jobs after job 0, one after the other), 0 (the CPU job).
    assert r.mean_wait_s == pytest.approx((0 + 99 + 109 + 0) / 4)


@pytest.mark.parametrize("flag, value", [("--swf-resource", "gpu:H100"),
                                         ("--swf-per-proc", "2"), ("--swf-queue", "batch")])
def test_cli_refuses_swf_flags_for_a_json_lines_trace(tmp_path, capsys, flag, value):
    # They used to be ignored without a word: the run was not what was asked for.
    path = _trace_file(tmp_path)
    assert main(["simulate", str(path), *EXAMPLE, flag, value]) == 2
    assert capsys.readouterr().err == (
        f"leasehold: INVALID_ARGUMENT: {flag} is for SWF traces; {path} is read as JSON lines "
        f"(--format swf, or a .swf file)\n")


def test_cli_checks_the_plot_path_before_simulating(tmp_path, capsys, monkeypatch):
    path = _trace_file(tmp_path)
    monkeypatch.setattr("engine._cli.simulate", lambda *a, **k: pytest.fail("simulated"))
    for plot, why in ((tmp_path / "none" / "x.png", "its directory does not exist"),
                      (tmp_path, "a directory, not a file")):
        assert main(["simulate", str(path), *EXAMPLE, "--plot", str(plot)]) == 2
        assert capsys.readouterr().err == (f"leasehold: INVALID_ARGUMENT: --plot {plot}: "
                                           f"{why}\n")
