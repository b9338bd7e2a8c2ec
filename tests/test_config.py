"""Tests for the config file model and parser (engine/_config.py)."""

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from engine._config import (
    GREEDY_CAPACITY,
    MAX_CLUSTERS,
    PRIORITY_NAMES,
    STRICT_FIFO,
    Config,
    load_config,
    parse_config,
    update_queue,
)
from engine._errors import ConfigError
from engine._units import UNLIMITED

EXAMPLE = Path(__file__).resolve().parent.parent / "engine" / "examples" / "leasehold.toml"
GI = 2**30
TI = 2**40

BASE = """
resources = ["cpu", "memory", "gpu:H100", "gpu:A100"]

[clusters.east]
capacity = { cpu = 64, memory = "512Gi", "gpu:H100" = 16 }

[clusters.west]
"""


def parse(text, source="test.toml"):
    return parse_config(tomllib.loads(text), source)


def config_error(text, *fragments, source="test.toml"):
    """Parse ``text``, expect a ConfigError naming the source and every fragment."""
    with pytest.raises(ConfigError) as info:
        parse(text, source)
    message = str(info.value)
    assert message.startswith(f"{source}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---------------------------------------------------------------------------------------------
# The bundled example


def test_example_loads():
    config = load_config(EXAMPLE)
    assert isinstance(config, Config)
    assert config.source == str(EXAMPLE)
    assert config.resources.names == ("cpu", "memory", "ephemeral_storage", "gpu:H100", "gpu:A100")
    assert [c.name for c in config.clusters] == ["east", "west", "cpu-pool"]
    assert [q.name for q in config.queues] == ["interactive", "gpu", "batch"]
    assert config.engine.default_queue == "batch"
    config.queue(config.engine.default_queue)


def test_example_details():
    config = load_config(EXAMPLE)
    east, west, pool = config.clusters
    h100 = config.resources.index("gpu:H100")
    a100 = config.resources.index("gpu:A100")
    assert east.capacity[h100] == 32 and east.capacity[a100] == 0
    assert [s.name for s in east.node_shapes] == ["h100x8", "cpu96"]
    assert east.node_shapes[0].count == 4 and east.node_shapes[0].allocatable[h100] == 8
    # west has no capacity table: derived from its node shapes
    assert west.capacity[a100] == 16 and west.capacity[0] == 2 * 94_000
    assert pool.node_shapes == () and pool.capacity[h100] == 0

    interactive, gpu, batch = config.queues
    assert interactive.priority == 1000 and interactive.scheduling == GREEDY_CAPACITY
    assert interactive.clusters == ("east", "west", "cpu-pool")
    assert gpu.scheduling == STRICT_FIFO and gpu.run_concurrency == 10
    assert gpu.max_resources[h100] == 24 and gpu.max_resources[a100] == 16
    assert gpu.max_resources[0] == 1000 * 1000
    assert gpu.clusters == ("east", "west")
    assert batch.priority == 0 and batch.depth == 100000
    assert np.all(batch.max_resources == UNLIMITED)


# ---------------------------------------------------------------------------------------------
# Defaults and derived values


def test_minimal_config_defaults():
    config = parse('resources = ["cpu"]\n[clusters.only]\n')
    assert config.source == "test.toml"
    assert config.engine.default_queue == "default"
    assert config.engine.max_candidates == 4096
    assert config.engine.dispatch_capacity == 65536
    assert config.engine.resource_gate == "enforce"
    assert config.engine.initial_capacity == 4096
    (cluster,) = config.clusters
    assert cluster.capacity is None  # unknown = unlimited
    assert cluster.node_shapes == ()
    (queue,) = config.queues  # the implicit default queue
    assert queue.name == "default"
    assert queue.priority == PRIORITY_NAMES["MEDIUM"] == 500
    assert queue.scheduling == STRICT_FIFO
    assert queue.run_concurrency == 0 and queue.action_concurrency == 0
    assert queue.depth == 10000
    assert queue.max_resources.dtype == np.int64
    assert list(queue.max_resources) == [UNLIMITED]
    assert queue.clusters == ("only",)


def test_source_default():
    assert parse_config({"resources": ["cpu"], "clusters": {"a": {}}}).source == "<config>"


def test_implicit_default_queue_is_added_after_configured_ones():
    config = parse(BASE + "[queues.z]\n[queues.a]\n")
    assert [q.name for q in config.queues] == ["z", "a", "default"]


def test_explicit_default_queue_is_used():
    config = parse(BASE + '[queues.default]\npriority = "MAX"\n')
    assert [q.name for q in config.queues] == ["default"]
    assert config.queue("default").priority == 1000


def test_named_default_queue_must_exist():
    config = parse(BASE + '[engine]\ndefault_queue = "main"\n[queues.main]\n')
    assert config.engine.default_queue == "main"
    assert [q.name for q in config.queues] == ["main"]
    config_error(
        BASE + '[engine]\ndefault_queue = "mian"\n[queues.main]\n',
        "engine.default_queue", "'mian'", "allowed:", "main",
    )


def test_lookup_by_name():
    config = parse(BASE + "[queues.q]\n")
    assert config.queue("q").name == "q"
    assert config.cluster("west").name == "west"
    with pytest.raises(KeyError):
        config.queue("nope")
    with pytest.raises(KeyError):
        config.cluster("nope")


def test_capacity_omitted_resources_are_zero_and_units_parse():
    config = parse(BASE)
    east = config.cluster("east")
    assert list(east.capacity) == [64_000, 512 * GI, 16, 0]


def test_quantity_spellings():
    config = parse("""
resources = ["cpu", "memory", "ephemeral_storage", "gpu:H100"]
[clusters.c]
capacity = { cpu = "500m", mem = "1.5Gi", disk = "2T", gpu = 3 }
""")
    assert list(config.cluster("c").capacity) == [500, 3 * GI // 2, 2 * 10**12, 3]


def test_capacity_derived_from_node_shapes():
    config = parse("""
resources = ["cpu", "memory", "gpu:H100"]
[[clusters.east.node_shapes]]
name = "big"
count = 2
allocatable = { cpu = 96, memory = "1Ti", "gpu:H100" = 8 }
[[clusters.east.node_shapes]]
count = 3
allocatable = { cpu = 16 }
""")
    east = config.cluster("east")
    big, small = east.node_shapes
    assert (big.name, big.count) == ("big", 2)
    assert list(big.allocatable) == [96_000, TI, 8]
    assert (small.name, small.count) == ("east-1", 3)  # default "<cluster>-<index>"
    assert list(small.allocatable) == [16_000, 0, 0]
    assert list(east.capacity) == [2 * 96_000 + 3 * 16_000, 2 * TI, 16]


def test_explicit_capacity_wins_over_node_shapes():
    config = parse("""
resources = ["cpu", "gpu:H100"]
[clusters.east]
capacity = { cpu = 10 }
[[clusters.east.node_shapes]]
count = 4
allocatable = { cpu = 96, "gpu:H100" = 8 }
""")
    east = config.cluster("east")
    assert list(east.capacity) == [10_000, 0]
    assert len(east.node_shapes) == 1


def test_vectors_are_read_only():
    config = parse(BASE + "[queues.q]\nmax_resources = { cpu = 1 }\n")
    with pytest.raises(ValueError):
        config.cluster("east").capacity[0] = 1
    with pytest.raises(ValueError):
        config.queue("q").max_resources[0] = 1


def test_order_is_file_order():
    config = parse("""
resources = ["cpu"]
[clusters.zeta]
[clusters.alpha]
[clusters.mid]
[queues.q3]
[queues.q1]
[queues.q2]
""")
    assert [c.name for c in config.clusters] == ["zeta", "alpha", "mid"]
    assert [q.name for q in config.queues] == ["q3", "q1", "q2", "default"]
    assert config.queue("q1").clusters == ("zeta", "alpha", "mid")


def test_engine_settings():
    config = parse(BASE + """
[engine]
max_candidates = 1
dispatch_capacity = 8
resource_gate = "off"
initial_capacity = 16
""")
    assert config.engine.max_candidates == 1
    assert config.engine.dispatch_capacity == 8
    assert config.engine.resource_gate == "off"
    assert config.engine.initial_capacity == 16


# ---------------------------------------------------------------------------------------------
# Priorities, clusters, budgets


@pytest.mark.parametrize(
    ("value", "expected"),
    [('"MIN"', 0), ('"MEDIUM"', 500), ('"MAX"', 1000), ("0", 0), ("731", 731), ("1000", 1000)],
)
def test_priority_values(value, expected):
    config = parse(BASE + f"[queues.q]\npriority = {value}\n")
    assert config.queue("q").priority == expected


@pytest.mark.parametrize("value", ['"HIGH"', '"max"', "-1", "1001", "true", "5.0", '"500"'])
def test_priority_invalid(value):
    message = config_error(
        BASE + f"[queues.gpu]\npriority = {value}\n",
        "queues.gpu.priority", "is invalid", "allowed: an integer 0..1000 or MIN, MEDIUM, MAX",
    )
    assert repr(tomllib.loads(f"v = {value}")["v"]) in message


def test_priority_error_message_exact():
    with pytest.raises(ConfigError) as info:
        parse(BASE + '[queues.gpu]\npriority = "HIGH"\n', "leasehold.toml")
    assert str(info.value) == (
        "leasehold.toml: queues.gpu.priority: 'HIGH' is invalid; "
        "allowed: an integer 0..1000 or MIN, MEDIUM, MAX"
    )


def test_star_means_all_clusters_in_config_order():
    config = parse(BASE + '[queues.q]\nclusters = ["*"]\n[queues.r]\n')
    assert config.queue("q").clusters == ("east", "west")
    assert config.queue("r").clusters == ("east", "west")  # default is ["*"]


def test_named_clusters():
    config = parse(BASE + '[queues.q]\nclusters = ["west"]\n')
    assert config.queue("q").clusters == ("west",)


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ('["north"]', ["'north'", "a configured cluster (east, west)"]),
        ("[]", ["[]", "east, west"]),
        ('"east"', ["'east'", "list of cluster names"]),
        ('["*", "east"]', ['"*" alone']),
        ('["east", "east"]', ["'east'", "each cluster named once"]),
        ("[1]", ["1 is invalid", "a configured cluster"]),
    ],
)
def test_queue_clusters_invalid(value, fragments):
    config_error(BASE + f"[queues.q]\nclusters = {value}\n", "queues.q.clusters", *fragments)


def test_max_accelerators_merged_into_max_resources():
    config = parse(BASE + """
[queues.gpu]
max_resources = { cpu = 100, memory = "1Ti" }
max_accelerators = { "gpu:H100" = 32 }
""")
    budget = config.queue("gpu").max_resources
    assert list(budget) == [100_000, TI, 32, UNLIMITED]


def test_device_in_max_resources_is_allowed():
    config = parse(BASE + '[queues.gpu]\nmax_resources = { "gpu:A100" = 4 }\n')
    assert list(config.queue("gpu").max_resources) == [UNLIMITED, UNLIMITED, UNLIMITED, 4]


def test_device_in_both_budgets_is_refused():
    config_error(
        BASE + """
[queues.gpu]
max_resources = { "gpu:H100" = 8 }
max_accelerators = { "gpu:H100" = 32 }
""",
        "queues.gpu.max_accelerators", "'gpu:H100'", "allowed:", "max_resources",
    )


@pytest.mark.parametrize("key", ["cpu", "gpu", "memory", "gpu:V100"])
def test_max_accelerators_needs_a_configured_device(key):
    config_error(
        BASE + f'[queues.gpu]\nmax_accelerators = {{ "{key}" = 1 }}\n',
        "queues.gpu.max_accelerators", repr(key), "allowed:", "gpu:H100, gpu:A100",
    )


# ---------------------------------------------------------------------------------------------
# Validation errors: each names the file, the key, the bad value and what is allowed


@pytest.mark.parametrize(
    ("snippet", "fragments"),
    [
        ('[queues.q]\nscheduling = "FIFO"\n',
         ["queues.q.scheduling", "'FIFO'", "allowed: STRICT_FIFO, GREEDY_CAPACITY"]),
        ("[queues.q]\nrun_concurrency = -1\n",
         ["queues.q.run_concurrency", "-1", "allowed: an integer >= 0"]),
        ("[queues.q]\naction_concurrency = -5\n",
         ["queues.q.action_concurrency", "-5", "allowed: an integer >= 0"]),
        ("[queues.q]\ndepth = 0\n", ["queues.q.depth", "0 is invalid", "allowed: an integer >= 1"]),
        ('[queues.q]\ndepth = "10"\n', ["queues.q.depth", "'10'", "allowed: an integer >= 1"]),
        ("[queues.q]\ndepth = true\n", ["queues.q.depth", "True", "allowed: an integer >= 1"]),
        ("[queues.q]\ndepth = 10.0\n", ["queues.q.depth", "10.0", "allowed: an integer >= 1"]),
        ("[queues.q]\nrun_concurrency = false\n",
         ["queues.q.run_concurrency", "False", "allowed: an integer >= 0"]),
        ("[engine]\nmax_candidates = 0\n",
         ["engine.max_candidates", "0 is invalid", "allowed: an integer >= 1"]),
        ("[engine]\ndispatch_capacity = -1\n",
         ["engine.dispatch_capacity", "-1", "allowed: an integer from 1 to 2147483647"]),
        ("[engine]\ninitial_capacity = 8\n",
         ["engine.initial_capacity", "8 is invalid", "allowed: an integer from 16 to 2147483647"]),
        ('[engine]\nresource_gate = "on"\n',
         ["engine.resource_gate", "'on'", "allowed: enforce, off"]),
        ("[engine]\ndefault_queue = 3\n", ["engine.default_queue", "3 is invalid", "allowed:"]),
        ('[engine]\ndefault_queue = "a b"\n', ["engine.default_queue", "'a b'", "letters"]),
        ('[queues]\nq = 1\n', ["queues.q", "1 is invalid", "allowed: a table"]),
        ('[queues."bad name"]\n', ["queues.bad name", "'bad name'", "letters, digits"]),
        ('[queues.q]\nmax_resources = { cpu = "lots" }\n',
         ["queues.q.max_resources", "'lots'", "not a quantity"]),
        ('[queues.q]\nmax_resources = { gpus = 1 }\n',
         ["queues.q.max_resources", "'gpus'", "configured: cpu, memory, gpu:H100, gpu:A100"]),
        ('[queues.q]\nmax_resources = { gpu = 1 }\n',
         ["queues.q.max_resources", "ambiguous"]),
        ('[queues.q]\nmax_resources = { memory = "1Gb" }\n',
         ["queues.q.max_resources", "'1Gb'", "allowed:", "Gi"]),
        ('[queues.q]\nmax_resources = { memory = 1, mem = 2 }\n',
         ["queues.q.max_resources.mem", "2 is invalid", "each resource once", "'memory'"]),
        ('[queues.q]\nmax_resources = 5\n', ["queues.q.max_resources", "5 is invalid", "a table"]),
        ('[queues.q]\nmax_accelerators = { "gpu:H100" = -1 }\n',
         ["queues.q.max_accelerators", "-1", "negative"]),
        ('[queues.q]\nmax_resources = { cpu = nan }\n',
         ["queues.q.max_resources.cpu", "nan is invalid", "a non-negative quantity"]),
        ('[queues.q]\nmax_resources = { cpu = inf }\n',
         ["queues.q.max_resources.cpu", "inf is not a finite quantity"]),
        ('[queues.q]\nmax_resources = { memory = "99999999Ei" }\n',
         ["queues.q.max_resources.memory", "'99999999Ei' is too large"]),
        ('[queues.q]\nmax_resources = { cpu = 4611686018427390 }\n',
         ["queues.q.max_resources.cpu", "4611686018427390 is too large"]),
    ],
)
def test_queue_and_engine_errors(snippet, fragments):
    config_error(BASE + snippet, *fragments)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[clusters.a]\n", ["resources", "missing", "allowed: a non-empty list"]),
        ("resources = []\n[clusters.a]\n", ["resources", "[]", "allowed: a non-empty list"]),
        ('resources = "cpu"\n[clusters.a]\n', ["resources", "'cpu'", "allowed: a non-empty list"]),
        ('resources = ["cpu", "cpu"]\n[clusters.a]\n', ["resources", "'cpu'", "twice"]),
        ('resources = ["CPU"]\n[clusters.a]\n', ["resources", "'CPU'", "lower-case"]),
        ('resources = ["cpu"]\n', ["clusters", "missing", "allowed: a table"]),
        ('resources = ["cpu"]\n[clusters]\n', ["clusters", "{}", "at least one"]),
        ('resources = ["cpu"]\nclusters = 3\n', ["clusters", "3 is invalid", "a table"]),
        ('resources = ["cpu"]\n[clusters."a/b"]\n', ["clusters.a/b", "'a/b'", "letters, digits"]),
        ('resources = ["cpu"]\n[clusters.a]\ncapacity = { cpu = -2 }\n',
         ["clusters.a.capacity", "-2", "negative"]),
        ('resources = ["cpu"]\n[clusters.a]\ncapacity = { cpu = true }\n',
         ["clusters.a.capacity", "True", "not a quantity"]),
        ('resources = ["cpu"]\n[clusters.a]\ncapacity = { cpu = "1Gi" }\n',
         ["clusters.a.capacity", "'1Gi'", "cpu takes cores or 'm'"]),
        ('resources = ["cpu"]\n[clusters.a]\nnode_shapes = 1\n',
         ["clusters.a.node_shapes", "1 is invalid", "allowed: a list"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\nallocatable = { cpu = 1 }\n',
         ["clusters.a.node_shapes[0].count", "missing", "allowed: an integer >= 1"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = 0\nallocatable = { cpu = 1 }\n',
         ["clusters.a.node_shapes[0].count", "0 is invalid", "allowed: an integer >= 1"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = -3\nallocatable = {cpu = 1}\n',
         ["clusters.a.node_shapes[0].count", "-3 is invalid", "allowed: an integer >= 1"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = "2"\nallocatable = {cpu = 1}\n',
         ["clusters.a.node_shapes[0].count", "'2' is invalid", "allowed: an integer >= 1"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = 1\n',
         ["clusters.a.node_shapes[0].allocatable", "missing", "allowed: a table"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = 1\nallocatable = {}\n',
         ["clusters.a.node_shapes[0].allocatable", "{}", "a non-empty table", "cpu"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = 1\nallocatable = {gpu = 1}\n',
         ["clusters.a.node_shapes[0].allocatable", "'gpu'", "configured: cpu"]),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\nname = ""\ncount = 1\n'
         "allocatable = {cpu = 1}\n",
         ["clusters.a.node_shapes[0].name", "''", "a non-empty name"]),
        ('resources = ["cpu"]\n'
         '[[clusters.a.node_shapes]]\nname = "n"\ncount = 1\nallocatable = {cpu = 1}\n'
         '[[clusters.a.node_shapes]]\nname = "n"\ncount = 1\nallocatable = {cpu = 2}\n',
         ["clusters.a.node_shapes[1].name", "'n'", "not used by another node shape"]),
        ('resources = ["memory"]\n'
         '[[clusters.a.node_shapes]]\ncount = 4000000\nallocatable = {memory = "2Ei"}\n',
         ["clusters.a.node_shapes", "memory", "too large", f"at most {UNLIMITED}"]),
    ],
)
def test_resource_and_cluster_errors(text, fragments):
    config_error(text, *fragments)


def test_too_many_clusters():
    ok = 'resources = ["cpu"]\n' + "".join(f"[clusters.c{i}]\n" for i in range(MAX_CLUSTERS))
    assert len(parse(ok).clusters) == MAX_CLUSTERS
    config_error(ok + "[clusters.extra]\n", "clusters", "65 clusters", "at most 64")


def test_engine_must_be_a_table():
    config_error('engine = "x"\n' + BASE, "engine", "'x' is invalid", "allowed: a table")


def test_not_a_table_at_top_level():
    with pytest.raises(ConfigError, match=r"<config>: \(top level\): \[1\] is invalid"):
        parse_config([1])


# ---------------------------------------------------------------------------------------------
# Unknown keys


@pytest.mark.parametrize(
    ("text", "where", "allowed"),
    [
        ("shards = 4\n" + BASE, "shards", "resources, engine, clusters, queues"),
        (BASE + "[engine]\nmax_candidate = 1\n", "engine.max_candidate",
         "default_queue, max_candidates, dispatch_capacity, resource_gate, initial_capacity"),
        (BASE.replace("[clusters.west]", "[clusters.west]\ncapacty = {}"),
         "clusters.west.capacty", "capacity, node_shapes"),
        ('resources = ["cpu"]\n[[clusters.a.node_shapes]]\ncount = 1\nallocatable = {cpu = 1}\n'
         "size = 3\n", "clusters.a.node_shapes[0].size", "name, count, allocatable"),
        (BASE + "[queues.q]\nmax_gpus = 3\n", "queues.q.max_gpus",
         "priority, scheduling, run_concurrency, action_concurrency, depth, max_resources, "
         "max_accelerators, clusters"),
    ],
)
def test_unknown_keys_are_refused(text, where, allowed):
    key = where.rsplit(".", 1)[-1]
    config_error(text, f"{where}: unknown key {key!r}", f"allowed keys: {allowed}")


# ---------------------------------------------------------------------------------------------
# Loading files


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "cannot read" in str(info.value)


def test_load_directory_is_unreadable(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)


@pytest.mark.parametrize("key", ["[storage]\npath", "[status]\ndir", "[worker]\nwork_dir",
                                 "[worker]\nlog_dir", "[security]\nkeys_dir"])
def test_a_path_with_a_nul_byte_is_refused_naming_the_key(key):
    # It passed the check; the shard then failed with "embedded null byte" (INTERNAL).
    table, name = key.split("\n")
    config_error(BASE + f'{table}\n{name} = "a\\u0000b"\n',
                 f"{table[1:-1]}.{name}: 'a\\x00b' is invalid; allowed: a non-empty directory "
                 f"path (no NUL byte)")


def test_a_config_nested_too_deeply_or_too_large_is_refused(tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="deep.toml: invalid TOML: nested too deeply"):
        load_config(deep)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (16 << 20) + b"\n")
    with pytest.raises(ConfigError, match="huge.toml: not a config file: larger than 16 MiB"):
        load_config(huge)


def test_load_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('resources = ["cpu"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: invalid TOML")


def test_load_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b'resources = ["cpu"]\n\xff\xfe\x00')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: invalid TOML: not UTF-8 text (invalid start byte "
                               f"at byte 20)")


def test_load_errors_name_the_file(tmp_path):
    path = tmp_path / "leasehold.toml"
    path.write_text(BASE + '[queues.gpu]\npriority = "HIGH"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: queues.gpu.priority: 'HIGH' is invalid")


def test_load_accepts_str_path():
    assert load_config(str(EXAMPLE)).source == str(EXAMPLE)


# ---------------------------------------------------------------------------------------------
# Live queue updates


@pytest.fixture
def live():
    config = parse(BASE + """
[queues.gpu]
priority = 700
scheduling = "STRICT_FIFO"
run_concurrency = 10
action_concurrency = 100
depth = 500
max_resources = { cpu = 100, memory = "1Ti" }
max_accelerators = { "gpu:H100" = 32 }
clusters = ["east"]
""")
    return config, config.queue("gpu")


def test_update_keeps_unchanged_keys(live):
    config, gpu = live
    new = update_queue(gpu, {"priority": "MAX", "depth": 10}, config)
    assert new is not gpu
    assert (new.name, new.priority, new.depth) == ("gpu", 1000, 10)
    assert new.scheduling == STRICT_FIFO
    assert (new.run_concurrency, new.action_concurrency) == (10, 100)
    assert new.clusters == ("east",)
    assert list(new.max_resources) == list(gpu.max_resources)
    assert gpu.priority == 700  # the old one is untouched


def test_update_all_keys(live):
    config, gpu = live
    new = update_queue(gpu, {
        "priority": 3,
        "scheduling": "GREEDY_CAPACITY",
        "run_concurrency": 0,
        "action_concurrency": 7,
        "depth": 1,
        "max_resources": {"cpu": 1},
        "max_accelerators": {"gpu:A100": 2},
        "clusters": ["*"],
    }, config)
    assert (new.priority, new.scheduling) == (3, GREEDY_CAPACITY)
    assert (new.run_concurrency, new.action_concurrency, new.depth) == (0, 7, 1)
    assert list(new.max_resources) == [1000, UNLIMITED, UNLIMITED, 2]
    assert new.clusters == ("east", "west")


def test_update_budget_parts(live):
    config, gpu = live
    # max_resources replaces the non-device part; device limits are kept
    new = update_queue(gpu, {"max_resources": {"memory": "2Ti"}}, config)
    assert list(new.max_resources) == [UNLIMITED, 2 * TI, 32, UNLIMITED]
    # max_accelerators replaces the device part; the rest is kept
    new = update_queue(gpu, {"max_accelerators": {"gpu:A100": 4}}, config)
    assert list(new.max_resources) == [100_000, TI, UNLIMITED, 4]
    # empty tables lift the limits
    new = update_queue(gpu, {"max_resources": {}, "max_accelerators": {}}, config)
    assert np.all(new.max_resources == UNLIMITED)
    # a device given in max_resources alone overrides the kept accelerator limit
    new = update_queue(gpu, {"max_resources": {"gpu:H100": 8}}, config)
    assert list(new.max_resources) == [UNLIMITED, UNLIMITED, 8, UNLIMITED]


def test_update_name_cannot_change(live):
    config, gpu = live
    assert update_queue(gpu, {"name": "gpu", "depth": 2}, config).depth == 2
    with pytest.raises(ConfigError) as info:
        update_queue(gpu, {"name": "other"}, config)
    assert str(info.value) == (
        "<queue update>: queues.gpu.name: 'other' is invalid; "
        "allowed: 'gpu' (a queue cannot be renamed)"
    )


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"priority": "HIGH"}, ["queues.gpu.priority", "'HIGH'", "MIN, MEDIUM, MAX"]),
        ({"priority": 1001}, ["queues.gpu.priority", "1001", "0..1000"]),
        ({"depth": 0}, ["queues.gpu.depth", "0 is invalid", "an integer >= 1"]),
        ({"depth": True}, ["queues.gpu.depth", "True", "an integer >= 1"]),
        ({"run_concurrency": -1}, ["queues.gpu.run_concurrency", "-1", ">= 0"]),
        ({"action_concurrency": 1.5}, ["queues.gpu.action_concurrency", "1.5", ">= 0"]),
        ({"scheduling": "LIFO"}, ["queues.gpu.scheduling", "'LIFO'", "STRICT_FIFO"]),
        ({"clusters": ["north"]}, ["queues.gpu.clusters", "'north'", "east, west"]),
        ({"max_resources": {"cpu": "x"}}, ["queues.gpu.max_resources", "'x'"]),
        ({"max_accelerators": {"cpu": 1}}, ["queues.gpu.max_accelerators", "'cpu'", "gpu:H100"]),
        ({"max_resources": {"gpu:H100": 1}, "max_accelerators": {"gpu:H100": 2}},
         ["queues.gpu.max_accelerators", "'gpu:H100'", "max_resources"]),
        ({"weight": 3}, ["queues.gpu.weight", "unknown key 'weight'", "allowed keys: priority"]),
    ],
)
def test_update_validation(live, changes, fragments):
    config, gpu = live
    with pytest.raises(ConfigError) as info:
        update_queue(gpu, changes, config, source="api")
    message = str(info.value)
    assert message.startswith("api: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_update_changes_must_be_a_table(live):
    config, gpu = live
    with pytest.raises(ConfigError, match=r"<queue update>: queues.gpu: \[\] is invalid"):
        update_queue(gpu, [], config)


# ---------------------------------------------------------------------------------------------
# [storage]


def test_storage_defaults_and_values():
    cfg = parse(BASE)
    assert (cfg.storage.path, cfg.storage.shard, cfg.storage.partitions) == (
        "leasehold-data", "shard-0", 16)
    cfg = parse(BASE + '[storage]\npath = "/data/s"\nshard = "s-1"\npartitions = 4\n'
                'map_size = "64Mi"\nmax_map_size = "1Gi"\nsync = false\nclaim_ttl = 5\n')
    s = cfg.storage
    assert (s.path, s.shard, s.partitions, s.map_size, s.max_map_size, s.sync, s.claim_ttl) == (
        "/data/s", "s-1", 4, 64 << 20, 1 << 30, False, 5.0)


@pytest.mark.parametrize("table,fragments", [
    ('partitions = 0', ("storage.partitions", "0")),
    ('partitions = 300', ("storage.partitions", "1 to 256")),
    ('map_size = "12Q"', ("storage.map_size", "12Q")),
    ('map_size = "10Ki"', ("storage.map_size", "at least 1Mi")),
    ('map_size = "2Gi"\nmax_map_size = "1Gi"', ("storage.max_map_size", ">= storage.map_size")),
    ('sync = "yes"', ("storage.sync", "true or false")),
    ('shard = "a b"', ("storage.shard",)),
    ('path = ""', ("storage.path",)),
    ('claim_ttl = -1', ("storage.claim_ttl",)),
    ('retention = "7 days"', ("storage.retention", "7 days", '"7d"')),
    ('retention = "-1h"', ("storage.retention",)),
    ('retention = -5', ("storage.retention",)),
    ('retention = true', ("storage.retention",)),
    # float() read these: other scripts' digits, underscores, spaces inside.
    ('retention = "\u0663d"', ("storage.retention",)),
    ('retention = "1_0d"', ("storage.retention", "1_0d")),
    ('retention = "7 d"', ("storage.retention",)),
    ('retention = " 7d "', ("storage.retention",)),
    ('paht = "x"', ("paht",)),
])
def test_storage_errors_name_the_key(table, fragments):
    config_error(BASE + "[storage]\n" + table + "\n", *fragments)


@pytest.mark.parametrize("value,seconds", [
    ('"7d"', 7 * 86400.0), ('"12h"', 43200.0), ('"30m"', 1800.0), ('"45s"', 45.0),
    ('"1.5h"', 5400.0), ("90", 90.0), ("0", 0.0)])
def test_storage_retention_takes_seconds_or_a_duration(value, seconds):
    assert parse(BASE + f"[storage]\nretention = {value}\n").storage.retention == seconds
    assert parse(BASE).storage.retention == 7 * 86400.0
# Backfill settings


def test_backfill_defaults_and_values():
    config = parse(BASE)
    assert all(q.backfill is False for q in config.queues)
    config = parse(BASE + """
[queues.gpu]
backfill = true
""")
    assert config.queue("gpu").backfill is True
    assert config.queue("gpu").scheduling == STRICT_FIFO


def test_backfill_only_with_strict_fifo():
    config_error(BASE + """
[queues.fast]
scheduling = "GREEDY_CAPACITY"
backfill = true
""", "queues.fast.backfill", "GREEDY_CAPACITY", "only with scheduling = STRICT_FIFO",
        "queue 'fast'")


def test_backfill_must_be_a_bool():
    config_error(BASE + """
[queues.gpu]
backfill = 1
""", "queues.gpu.backfill", "true or false")


@pytest.mark.parametrize("value", ["0.9", "0.5"])
def test_backfill_percentile_was_removed_and_says_what_replaced_it(value):
    # Issue 14: predictions are no longer one percentile per task (docs/predictions.md).
    config_error(BASE + f"""
[engine]
backfill_percentile = {value}
""", "engine.backfill_percentile was removed", "last two successes", "delete the key")


@pytest.mark.parametrize("value", ["64", "1", "0"])
def test_backfill_max_candidates_was_removed_and_says_what_replaced_it(value):
    # Issue 14: a fixed number of backfill tests per head cost mean wait on deep queues.
    config_error(BASE + f"""
[engine]
backfill_max_candidates = {value}
""", "engine.backfill_max_candidates was removed", "engine.max_candidates",
        "delete the key")


def test_update_queue_may_change_backfill_and_keeps_the_rule():
    config = parse(BASE + """
[queues.gpu]
[queues.fast]
scheduling = "GREEDY_CAPACITY"
""")
    gpu = update_queue(config.queue("gpu"), {"backfill": True}, config)
    assert gpu.backfill is True
    assert update_queue(gpu, {"backfill": False}, config).backfill is False
    assert update_queue(gpu, {"priority": 3}, config).backfill is True   # kept
    with pytest.raises(ConfigError, match=r"queues.fast.backfill.*STRICT_FIFO"):
        update_queue(config.queue("fast"), {"backfill": True}, config)
    with pytest.raises(ConfigError, match=r"queues.gpu.backfill.*GREEDY_CAPACITY"):
        update_queue(gpu, {"scheduling": "GREEDY_CAPACITY"}, config)


# ---------------------------------------------------------------------------------------------
# [worker], engine.pause_on_expiry


def test_worker_defaults_and_values():
    w = parse(BASE).worker
    assert (w.slots, w.capacity, w.node_shapes, w.on_shard_lost, w.default_plugin) == (
        0, None, (), "reconnect", None)
    w = parse(BASE + '[worker]\nslots = 8\ncapacity = { cpu = 4 }\non_shard_lost = "exit"\n'
                     'drain_timeout = 5\nkill_grace = 0.5\nwork_dir = "/w"\nlog_dir = "/l"\n'
                     'default_plugin = "sim"\nreport_free = false\n').worker
    cpu = parse(BASE).resources.index("cpu")
    assert (w.slots, int(w.capacity[cpu]), w.on_shard_lost, w.drain_timeout, w.kill_grace,
            w.work_dir, w.log_dir, w.default_plugin, w.report_free) == (
        8, 4000, "exit", 5.0, 0.5, "/w", "/l", "sim", False)
    assert parse(BASE).worker.max_log_bytes == 10 << 30
    assert parse(BASE + '[worker]\nmax_log_bytes = "64Mi"\n').worker.max_log_bytes == 64 << 20
    assert parse(BASE + "[worker]\nmax_log_bytes = 0\n").worker.max_log_bytes == 0
    assert parse(BASE).engine.pause_on_expiry is True
    assert parse(BASE + "[engine]\npause_on_expiry = false\n").engine.pause_on_expiry is False


@pytest.mark.parametrize("table,fragments", [
    ("slots = -1", ("worker.slots", "-1")),
    ('on_shard_lost = "retry"', ("worker.on_shard_lost", '"reconnect" or "exit"')),
    ("drain_timeout = -2", ("worker.drain_timeout",)),
    ('kill_grace = "soon"', ("worker.kill_grace",)),
    ('work_dir = ""', ("worker.work_dir",)),
    ("max_log_bytes = -1", ("worker.max_log_bytes", "negative")),
    ('max_log_bytes = "lots"', ("worker.max_log_bytes", '"10Gi"')),
    ("max_log_bytes = 100", ("worker.max_log_bytes", "at least 1Ki, or 0")),
    ('default_plugin = "k8s"', ("worker.default_plugin", "process, python, sim")),
    ('report_free = "yes"', ("worker.report_free", "true or false")),
    ("capacity = { tpu = 1 }", ("tpu",)),
    ('colour = "blue"', ("worker.colour",)),
])
def test_worker_errors_name_the_key(table, fragments):
    config_error(BASE + "[worker]\n" + table + "\n", *fragments)


def test_pause_on_expiry_must_be_a_boolean():
    config_error(BASE + '[engine]\npause_on_expiry = "no"\n', "engine.pause_on_expiry",
                 "true or false")


# ---------------------------------------------------------------------------------------------
# Tenant caps ([tenants.NAME], [tenant_defaults])


def test_tenant_caps_default_to_unlimited():
    config = parse(BASE)
    assert config.tenants == ()
    caps = config.tenant("anyone")
    assert (caps.name, caps.run_concurrency, caps.action_concurrency) == ("anyone", 0, 0)


def test_a_named_tenant_overrides_the_defaults_key_by_key():
    config = parse(BASE + "[tenant_defaults]\nrun_concurrency = 2\naction_concurrency = 10\n"
                   "[tenants.acme]\naction_concurrency = 500\n"
                   "[tenants.free-tier]\nrun_concurrency = 1\naction_concurrency = 1\n"
                   "[tenants.vip]\nrun_concurrency = 0\naction_concurrency = 0\n")
    assert [t.name for t in config.tenants] == ["acme", "free-tier", "vip"]
    got = {n: (config.tenant(n).run_concurrency, config.tenant(n).action_concurrency)
           for n in ("acme", "free-tier", "vip", "someone")}
    assert got == {"acme": (2, 500), "free-tier": (1, 1), "vip": (0, 0), "someone": (2, 10)}
    assert config.tenant("someone").name == "someone"


@pytest.mark.parametrize("snippet, fragments", [
    ("[tenants.acme]\naction_concurrency = -1",
     ["tenants.acme.action_concurrency", "-1", "an integer >= 0"]),
    ('[tenants.acme]\nrun_concurrency = "3"', ["tenants.acme.run_concurrency", "'3'"]),
    ("[tenants.acme]\nrun_concurrency = 2.0", ["tenants.acme.run_concurrency", "2.0"]),
    ("[tenants.acme]\nrun_concurrency = true", ["tenants.acme.run_concurrency", "True"]),
    ("[tenants.acme]\nmax_actions = 3",
     ["tenants.acme.max_actions", "unknown key 'max_actions'", "run_concurrency",
      "action_concurrency"]),
    ("[tenant_defaults]\naction_concurrency = -5",
     ["tenant_defaults.action_concurrency", "-5"]),
    ("[tenant_defaults]\nqueue = 1", ["tenant_defaults.queue", "unknown key 'queue'"]),
    ('tenant_defaults = 3', ["tenant_defaults", "3", "a table"]),
    ('tenants = "acme"', ["tenants", "'acme'", "a table"]),
    ("[tenants]\nacme = 3", ["tenants.acme", "3", "a table"]),
    ('[tenants."acme/ml"]\nrun_concurrency = 1', ["tenants.acme/ml", "a tenant name"]),
    ('[tenants."_x"]\nrun_concurrency = 1', ["tenants._x", "first segment of an action id"]),
])
def test_tenant_errors_name_the_key(snippet, fragments):
    # A top-level key goes before the tables (after them it would be [clusters.west]'s).
    text = BASE + snippet + "\n" if snippet.startswith("[") else snippet + "\n" + BASE
    config_error(text, *fragments)


@pytest.mark.parametrize("snippet, fragments", [
    ("[engine]\nheartbeat_interval = 1e300\n",
     ["engine.heartbeat_interval: 1e+300 is invalid; allowed: a number of seconds "
      ">= 0.000001 and at most 315360000 (10 years)"]),
    # Positive, yet 0 once made nanoseconds: every lease expired as it was handed out.
    ("[engine]\nheartbeat_interval = 5e-324\n", ["engine.heartbeat_interval: 5e-324 is invalid"]),
    ("[engine]\nfinalize_timeout = 1e-12\n", ["engine.finalize_timeout: 1e-12 is invalid"]),
    ("[engine]\nfinalize_timeout = 1e10\n", ["engine.finalize_timeout: 10000000000.0"]),
    ("[engine]\nexpiry_jitter = 1e12\n", ["engine.expiry_jitter", "10 years"]),
    ("[storage]\nclaim_ttl = 1e300\n", ["storage.claim_ttl", "10 years"]),
    ("[storage]\nretention = 1e300\n", ["storage.retention", "10 years"]),
    ('[storage]\nretention = "4000d"\n', ["storage.retention: '4000d' is invalid", "10 years"]),
    ("[supervisor]\nstart_timeout = 1e300\n", ["supervisor.start_timeout", "10 years"]),
    ("[engine]\nheartbeat_interval = 1e6\nexpiry_missed_beats = 1000\n",
     ["engine.expiry_missed_beats: 1000 is invalid; allowed: heartbeat_interval x "
      "expiry_missed_beats + expiry_jitter (the lease ttl, 1000000002.0s here) at most "
      "315360000 (10 years)"]),
    ("[engine]\nexpiry_missed_beats = 4611686018427387904\n", ["engine.expiry_missed_beats"]),
])
def test_absurd_durations_are_refused_before_they_overflow_the_clock(snippet, fragments):
    # Times become int64 nanoseconds on the clock (now + ttl): 1e300 seconds used to pass
    # the check and fail the engine's start with an OverflowError.
    config_error(BASE + snippet, *fragments)


def test_ten_years_is_the_longest_duration():
    cfg = parse(BASE + '[storage]\nretention = "3650d"\nclaim_ttl = 315360000\n')
    assert cfg.storage.retention == cfg.storage.claim_ttl == 315360000.0


@pytest.mark.parametrize("snippet, fragment", [
    ("[engine]\ninitial_capacity = 4611686018427387904\n",
     "engine.initial_capacity: 4611686018427387904 is invalid; allowed: an integer from 16 "
     "to 2147483647 (rows are int32)"),
    ("[engine]\ndispatch_capacity = 2147483648\n",
     "engine.dispatch_capacity: 2147483648 is invalid; allowed: an integer from 1 to "
     "2147483647 (rows are int32)"),
    ("[transport]\nhwm = 4611686018427387904\n",
     "transport.hwm: 4611686018427387904 is invalid; allowed: an integer from 1 to "
     "2147483647 (a ZeroMQ int)"),
])
def test_sizes_past_their_type_are_refused_naming_the_key(snippet, fragment):
    # They used to pass the check, then fail the engine's or the socket's start with a
    # MemoryError, a ValueError ("array is too big") or an OverflowError.
    config_error(BASE + snippet, fragment)


def test_the_largest_sizes_are_accepted():
    cfg = parse(BASE + "[engine]\ndispatch_capacity = 2147483647\n"
                "[transport]\nhwm = 2147483647\n")
    assert cfg.engine.dispatch_capacity == cfg.transport.hwm == 2**31 - 1


def test_a_map_size_above_the_default_max_names_map_size():
    # It used to say "storage.max_map_size: None is invalid" (a key the file does not set).
    config_error(BASE + '[storage]\nmap_size = "128Gi"\n',
                 "storage.map_size: '128Gi' is invalid; allowed: a size <= "
                 "storage.max_map_size (68719476736 bytes, its default)")
    config_error(BASE + '[storage]\nmap_size = "2Gi"\nmax_map_size = "1Gi"\n',
                 "storage.max_map_size: '1Gi' is invalid; allowed: a size >= storage.map_size")


@pytest.mark.parametrize("endpoints, fragment", [
    ('["tcp://127.0.0.1:7700", "tcp://127.0.0.1:7700"]',
     "transport.endpoints: 'tcp://127.0.0.1:7700' is invalid; allowed: each endpoint once "
     "(shards 0 and 1 would bind the same one)"),
    ('["ipc:///tmp/s", "tcp://h:1", "ipc:///tmp/s"]', "(shards 0 and 2 would bind the same one)"),
    ('["tcp://127.0.0.1:99999"]',
     "transport.endpoints: 'tcp://127.0.0.1:99999' is invalid; allowed: a tcp port 0..65535"),
    # No other process can reach an inproc endpoint; a host is ASCII (it failed at bind).
    ('["inproc://x"]', "allowed: a non-empty list of ZeroMQ endpoints (tcp://HOST:PORT or "
                       "ipc://PATH)"),
    ('["tcp://\u00fc:5"]', "allowed: a non-empty list of ZeroMQ endpoints"),
    # A Unix socket's path has room for 107 bytes: a longer one failed in the client's
    # connect as INTERNAL (the shard's bind said UNAVAILABLE).
    (f'["ipc:///tmp/{"a" * 103}"]', "allowed: an ipc path of at most 107 bytes"),
])
def test_endpoints_that_cannot_all_bind_are_refused(endpoints, fragment):
    # They passed the check; the second shard then failed "Address already in use" at its
    # start (and the supervisor restarted it), a port past 65535 failed every bind.
    config_error(BASE + f"[transport]\nendpoints = {endpoints}\n", fragment)


@pytest.mark.parametrize("endpoints, metrics, message", [
    (["tcp://127.0.0.1:7700", "tcp://localhost:7700"], False,
     "transport.endpoints[1]: 'tcp://localhost:7700' is invalid; allowed: a port no other "
     "endpoint binds on the same address (transport.endpoints[0] 'tcp://127.0.0.1:7700' binds "
     "port 7700 on 127.0.0.1, this one on 127.0.0.1 too)"),
    (["tcp://0.0.0.0:7700", "tcp://127.0.0.1:7701", "tcp://127.0.0.1:7700"], False,
     "transport.endpoints[2]: 'tcp://127.0.0.1:7700' is invalid; allowed: a port no other "
     "endpoint binds on the same address (transport.endpoints[0] 'tcp://0.0.0.0:7700' binds "
     "port 7700 on every address, this one on 127.0.0.1)"),
    (["tcp://127.0.0.1:7700", "tcp://*:7700"], False,
     "transport.endpoints[1]: 'tcp://*:7700' is invalid; allowed: a port no other endpoint "
     "binds on the same address (transport.endpoints[0] 'tcp://127.0.0.1:7700' binds port "
     "7700 on 127.0.0.1, this one on every address)"),
    (["tcp://127.0.0.1:7700"], "localhost:7700",
     "status.metrics: 'localhost:7700' is invalid; allowed: a port no endpoint binds on the "
     "same address (transport.endpoints[0] 'tcp://127.0.0.1:7700' binds port 7700 on "
     "127.0.0.1, this one on 127.0.0.1 too)"),
])
def test_two_spellings_of_one_port_are_refused_naming_both_keys(endpoints, metrics, message):
    # They passed the check (the strings differ), then the second bind failed "Address
    # already in use": a shard restarted for ever by the supervisor, or the metrics.
    metrics = "false" if metrics is False else f'"{metrics}"'
    config_error(BASE + f"[transport]\nendpoints = {json.dumps(endpoints)}\n"
                 f"[status]\nmetrics = {metrics}\n", f"test.toml: {message}")


def test_one_port_on_two_addresses_is_accepted():
    eps = ["tcp://127.0.0.1:7700", "tcp://127.0.0.2:7700", "tcp://no-such-host.invalid:7700"]
    cfg = parse(BASE + f"[transport]\nendpoints = {json.dumps(eps)}\n"
                f'[status]\nmetrics = "127.0.0.3:7700"\n')
    assert cfg.transport.endpoints == tuple(eps)


def test_endpoints_a_shard_may_bind_are_accepted():
    eps = ["tcp://*:7000", "tcp://[::1]:7001", "tcp://eth0:7002", "tcp://host-1.example:7003",
           "tcp://my_host:7004", "tcp://[fe80::1%eth0]:7005", "ipc:///tmp/leasehold-shard"]
    assert parse(BASE + f"[transport]\nendpoints = {eps!r}\n".replace("'", '"')
                 ).transport.endpoints == tuple(eps)


def test_ephemeral_endpoints_may_repeat():
    eps = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]
    assert parse(BASE + f"[transport]\nendpoints = {eps!r}\n".replace("'", '"')
                 ).transport.endpoints == tuple(eps)


def test_an_ipc_path_at_the_systems_limit_is_accepted():
    ep = f"ipc:///tmp/{'a' * 102}"       # 107 bytes of path
    assert parse(BASE + f'[transport]\nendpoints = ["{ep}"]\n').transport.endpoints == (ep,)


@pytest.mark.parametrize("value", ["2000", "4611686018427387903"])
def test_max_node_pods_has_an_upper_bound(value):
    # 2**62 passed the check, crashed the first start (INTERNAL) and, written into the
    # store's layout first, made the store refuse every later config.
    config_error(BASE + f"[engine]\nmax_node_pods = {value}\n",
                 f"engine.max_node_pods: {value} is invalid; allowed: an integer from 1 to "
                 f"1024 (4 bytes a pod in every action row and record)")


@pytest.mark.parametrize("value", ['["sim"]', "{ name = \"sim\" }", "3"])
def test_a_default_plugin_that_is_not_a_name_is_refused(value):
    # A list was INTERNAL: "unhashable type: 'list'".
    config_error(BASE + f"[worker]\ndefault_plugin = {value}\n",
                 "worker.default_plugin:")


@pytest.mark.parametrize("worker, fragment", [
    ('capacity = { cpu = "7x" }', "worker.capacity.cpu: '7x' has unit 'x'"),
    ("capacity = 3", "worker.capacity: 3 is invalid; allowed: a table"),
    ("node_shapes = [{ count = 0, allocatable = { cpu = 4 } }]",
     "worker.node_shapes[0].count: 0 is invalid"),
])
def test_the_workers_own_capacity_errors_name_the_worker_table(worker, fragment):
    # They said "clusters.worker.capacity...", a key no file has.
    message = config_error(BASE + f"[worker]\n{worker}\n", fragment)
    assert "clusters.worker" not in message


def test_a_default_queue_with_no_queues_configured_names_the_one_choice():
    # It listed "a configured queue (), or 'default' ...".
    message = config_error('resources = ["cpu"]\n[clusters.east]\n[engine]\n'
                           'default_queue = "nope"\n', "engine.default_queue: 'nope' is "
                           "invalid; allowed: 'default' (no queues are configured: an "
                           "implicit default queue)")
    assert "()" not in message
