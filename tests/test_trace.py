"""Trace files: JSON lines and SWF parse into jobs; bad input names file, line and field."""

import json

import pytest

from engine._trace import SwfMapping, TraceError, load_trace, parse_jsonl, parse_swf
from engine.cli import main


def _jsonl(*objs):
    return [json.dumps(o) for o in objs]


def test_jsonl_pods_flat_resources_defaults_and_order():
    lines = [
        "# a comment",
        "",
        *_jsonl(
            {"submit": 30, "runtime": 10.5, "queue": "gpu", "task": "train", "id": "t1",
             "pods": [{"count": 2, "resources": {"cpu": 4, "gpu:H100": 8, "memory": "64Gi"}},
                      {"resources": {"cpu": 1}}], "estimate": 20},
            {"submit": 0, "runtime": 5, "resources": {"cpu": "500m"}},
        ),
    ]
    trace = parse_jsonl(lines, "t.jsonl")
    first, second = trace.jobs
    assert (first.id, first.submit, first.runtime, first.queue, first.task) == (
        "4", 0.0, 5.0, None, "1x[cpu=500m]")
    assert first.pods == ((1, {"cpu": "500m"}),) and first.n_pods == 1
    assert first.where == "t.jsonl:4"
    assert second.id == "t1" and second.queue == "gpu" and second.task == "train"
    assert second.pods == ((2, {"cpu": 4, "gpu:H100": 8, "memory": "64Gi"}), (1, {"cpu": 1}))
    assert second.n_pods == 3 and second.estimate == 20.0
    assert trace.skipped == 0


def test_jsonl_ties_keep_file_order():
    trace = parse_jsonl(_jsonl(*({"submit": 1, "runtime": 1, "resources": {"cpu": 1},
                                  "id": f"j{i}"} for i in range(5))))
    assert [j.id for j in trace.jobs] == ["j0", "j1", "j2", "j3", "j4"]


@pytest.mark.parametrize("line, expected", [
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}', "t.jsonl:2: invalid JSON"),
    ('[1, 2]', "t.jsonl:2: a job must be a JSON object"),
    ('{"runtime": 1, "resources": {"cpu": 1}}', "t.jsonl:2: submit: missing"),
    ('{"submit": -1, "runtime": 1, "resources": {"cpu": 1}}', "t.jsonl:2: submit: -1 must be >= 0"),
    ('{"submit": 0, "runtime": 0, "resources": {"cpu": 1}}', "t.jsonl:2: runtime: 0 must be > 0"),
    ('{"submit": "soon", "runtime": 1, "resources": {"cpu": 1}}',
     "t.jsonl:2: submit: 'soon' is not a number of seconds"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "prio": 3}',
     "t.jsonl:2: unknown key(s) prio; allowed: id, submit"),
    ('{"submit": 0, "runtime": 1}', "t.jsonl:2: pods/resources: give exactly one"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "pods": []}',
     "t.jsonl:2: pods/resources: give exactly one"),
    ('{"submit": 0, "runtime": 1, "pods": []}', "t.jsonl:2: pods: [] is not a non-empty list"),
    ('{"submit": 0, "runtime": 1, "pods": [{"count": 0, "resources": {"cpu": 1}}]}',
     "t.jsonl:2: pods[0].count: 0 is not an integer"),
    ('{"submit": 0, "runtime": 1, "pods": [{"count": 2}]}',
     "t.jsonl:2: pods[0].resources: missing"),
    ('{"submit": 0, "runtime": 1, "pods": [{"count": 2, "resources": {"cpu": [1]}}]}',
     "t.jsonl:2: pods[0].resources.cpu: [1] is not a quantity"),
    ('{"submit": 0, "runtime": 1, "resources": {}}', "t.jsonl:2: resources: {} is not a non-empty"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "queue": 7}',
     "t.jsonl:2: queue: 7 is not a queue name"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "task": ""}',
     "t.jsonl:2: task: '' is not a non-empty string"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "id": "a/b"}',
     "t.jsonl:2: id: 'a/b' is not an integer or a name"),
    ('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "id": "x"}',
     "t.jsonl:2: id: 'x' is also the id of line 1"),
])
def test_jsonl_errors_name_file_line_and_field(line, expected):
    good = '{"submit": 0, "runtime": 1, "resources": {"cpu": 1}, "id": "x"}'
    with pytest.raises(TraceError) as err:
        parse_jsonl([good, line], "t.jsonl")
    assert str(err.value).startswith(expected), str(err.value)
    assert err.value.code == "INVALID_TRACE"


SWF = """\
; Version: 2.2
; Computer: a test machine
; MaxProcs: 64
1 0 5 100 4 -1 -1 4 200 -1 1 7 1 3 1 -1 -1 -1
2 10 0 50 -1 -1 -1 8 -1 -1 1 9 1 -1 1 -1 -1 -1
3 20 0 -1 2 -1 -1 2 60 -1 0 7 1 3 1 -1 -1 -1
4 25 0 0 2 -1 -1 2 60 -1 0 7 1 3 1 -1 -1 -1
5 30 0 10 -1 -1 -1 -1 60 -1 0 7 1 3 1 -1 -1 -1
6 5 0 20 1 -1 -1 1 30 -1 1 -1 1 -1 1 -1 -1 -1
"""


def test_swf_fields_mapping_and_skips():
    trace = parse_swf(SWF.splitlines(), "w.swf", SwfMapping("gpu:H100", 2, "batch"))
    assert [j.id for j in trace.jobs] == ["1", "6", "2"]
    j1, j6, j2 = trace.jobs
    assert (j1.submit, j1.runtime, j1.estimate, j1.task, j1.queue) == (0, 100, 200, "exe3", "batch")
    assert j1.pods == ((4, {"gpu:H100": 2}),) and j1.where == "w.swf:4"
    assert j2.pods == ((8, {"gpu:H100": 2}),)   # no allocated count: the requested one
    assert j2.task == "user9" and j2.estimate is None
    assert j6.task == "job" and j6.n_pods == 1
    assert trace.skipped == 3
    assert trace.skipped_reasons == {"no run time (-1)": 1, "run time <= 0": 1,
                                     "no processor count (-1)": 1}


@pytest.mark.parametrize("line, expected", [
    ("1 0 5 100 4", "w.swf:2: expected 18 whitespace-separated fields, found 5"),
    ("1 0 5 1x0 4 -1 -1 4 200 -1 1 7 1 3 1 -1 -1 -1",
     "w.swf:2: field 4 (run time): '1x0' is not a number"),
    ("1 0 5 100 2.5 -1 -1 4 200 -1 1 7 1 3 1 -1 -1 -1",
     "w.swf:2: field 5 (allocated processors): '2.5' is not a whole processor count"),
    ("1 0 5 100 4 -1 -1 4 200 -1 1 7 1 3 1 -1 -1 nan",
     "w.swf:2: field 18 (think time): 'nan' is not a number"),
])
def test_swf_errors_name_file_line_and_field(line, expected):
    with pytest.raises(TraceError) as err:
        parse_swf(["; header", line], "w.swf")
    assert str(err.value).startswith(expected), str(err.value)


def test_load_trace_picks_the_format_by_suffix_and_reports_unreadable_files(tmp_path):
    swf = tmp_path / "w.swf"
    swf.write_text(SWF)
    assert len(load_trace(swf).jobs) == 3
    jl = tmp_path / "t.trace"
    jl.write_text('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}}\n')
    assert len(load_trace(jl).jobs) == 1
    with pytest.raises(TraceError, match="t.trace:1: expected 18"):
        load_trace(jl, fmt="swf")
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.jsonl")
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(bad)
    with pytest.raises(TraceError, match="unknown trace format 'csv'"):
        load_trace(jl, fmt="csv")


def test_cli_reports_a_bad_trace_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"submit": 0, "runtime": 1, "resources": {"cpu": 1}}\n{"submit": 0}\n')
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"leasehold: INVALID_TRACE: {bad}:2: runtime: missing")
    assert "Traceback" not in err
