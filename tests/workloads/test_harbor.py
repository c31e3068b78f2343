"""Harbor task directories: every field is read or refused with the file, the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.workloads.harbor import HarborTaskError, is_harbor_path, load_harbor, load_task

DOCKERFILE = "FROM ubuntu:24.04\nWORKDIR /app\n"
FULL_TOML = """
schema_version = "1.1"

[task]
name = "belayer/fix-bug"
description = "fix a bug"
authors = [{ name = "A", email = "a@example.com" }]
keywords = ["python"]

[metadata]
difficulty = "easy"
tags = ["x"]

[verifier]
timeout_sec = 30.0
env = { MODE = "strict" }
user = "root"

[agent]
timeout_sec = 120.0
user = 1000

[solution]
env = { HINT = "1" }

[environment]
build_timeout_sec = 300.0
cpus = 2
memory_mb = 1024
storage_mb = 2048
allow_internet = false
workdir = "/app"
env = { TOKEN = "${BELAYER_TEST_TOKEN}", LEVEL = "${BELAYER_TEST_UNSET:-low}" }

[environment.healthcheck]
command = "test -f /app/ready"
retries = 2
"""


def make_task(root: Path, name: str = "fix-bug", toml: str = FULL_TOML, *, dockerfile: str | None = DOCKERFILE,
              instruction: str | None = "Fix the bug.\n", test_sh: bool = True, solution: bool = True) -> Path:  # fmt: skip
    task = root / name
    task.mkdir(parents=True)
    (task / "task.toml").write_text(toml)
    if instruction is not None:
        (task / "instruction.md").write_text(instruction)
    if dockerfile is not None:
        (task / "environment").mkdir()
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    if test_sh:
        (task / "tests").mkdir()
        (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    if solution:
        (task / "solution").mkdir()
        (task / "solution" / "solve.sh").write_text("true\n")
    return task


def refused(path: Path, *expected: str) -> str:
    with pytest.raises(HarborTaskError) as caught:
        load_harbor(path, env={"BELAYER_TEST_TOKEN": "t"})
    message = str(caught.value)
    for part in expected:
        assert part in message, message
    return message


def test_every_field_is_read(tmp_path):
    task = load_task(make_task(tmp_path), env={"BELAYER_TEST_TOKEN": "secret"})
    config = task.config
    assert (
        task.id == "fix-bug"
        and not task.multi_step
        and task.dockerfile == tmp_path / "fix-bug/environment/Dockerfile"
    )
    assert config.task.name == "belayer/fix-bug" and config.task.authors[0].email == "a@example.com"
    assert config.metadata == {"difficulty": "easy", "tags": ["x"]}
    assert (config.verifier.timeout_sec, config.verifier.env, config.verifier.user) == (
        30.0,
        {"MODE": "strict"},
        "root",
    )
    assert (config.agent.timeout_sec, config.agent.user) == (120.0, 1000)
    assert config.solution.env == {"HINT": "1"}
    environment = config.environment
    assert (environment.cpus, environment.memory_mb, environment.storage_mb) == (2, 1024, 2048)
    assert (environment.workdir, environment.build_timeout_sec) == ("/app", 300.0)
    assert environment.env == {"TOKEN": "secret", "LEVEL": "low"}
    assert environment.healthcheck.command == "test -f /app/ready" and environment.healthcheck.retries == 2
    assert not task.wants_network
    (step,) = task.steps
    assert step.instruction == "Fix the bug.\n" and step.tests_dirs == (tmp_path / "fix-bug/tests",)
    assert step.solution_dir == tmp_path / "fix-bug/solution"


def test_harbor_defaults_ask_for_network_and_keep_the_images_user(tmp_path):
    task = load_task(make_task(tmp_path, toml='version = "1.0"\n'), env={})
    assert task.wants_network  # Harbor's default allow_internet = true: the caller warns or refuses
    assert task.config.verifier.timeout_sec == 600.0 and task.config.verifier.user is None
    assert task.config.environment.workdir is None and task.config.version == "1.0"


def test_deprecated_sizes_are_converted_with_a_warning(tmp_path):
    task = load_task(make_task(tmp_path, toml='[environment]\nmemory = "2G"\nstorage = "512M"\n'), env={})
    assert (task.config.environment.memory_mb, task.config.environment.storage_mb) == (2048, 512)
    assert any("memory is deprecated" in warning for warning in task.warnings)
    refused(
        make_task(tmp_path, "bad-size", toml='[environment]\nmemory = "lots"\n'), "environment.memory", "'2G'"
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[environment]\ncpu = 2\n", "field environment.cpu: unknown field"),
        ("[verifier]\ntimeout_sec = -1\n", "field verifier.timeout_sec"),
        ("[verifier]\ntimeout = 5\n", "field verifier.timeout: unknown field"),
        ("[environment]\ngpus = 1\n", "sandboxes have no accelerators"),
        ('[environment]\nworkdir = "app"\n', "absolute path"),
        ('[[environment.mcp_servers]]\nname = "x"\n', "MCP servers are not supported"),
        ('[environment]\nos = "windows"\n', "only Linux containers"),
        ("[agent]\nuser = [1]\n", "field agent.user"),
        ("surprise = 1\n", "field surprise: unknown field"),
        ("[environment\n", "not valid TOML"),
    ],
)
def test_a_malformed_field_names_the_file_and_the_field(tmp_path, toml, expected):
    message = refused(make_task(tmp_path, toml=toml), expected)
    assert str(tmp_path / "fix-bug" / "task.toml") in message


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"instruction": None}, "instruction.md: missing"),
        ({"instruction": "  \n"}, "instruction.md: empty"),
        ({"test_sh": False}, "tests/test.sh: missing"),
        ({"dockerfile": None}, "no environment/Dockerfile and no [environment].docker_image"),
    ],
)
def test_a_missing_file_is_named(tmp_path, kwargs, expected):
    refused(make_task(tmp_path, toml="", **kwargs), expected)


def test_a_prebuilt_image_needs_no_dockerfile_and_compose_is_refused(tmp_path):
    task = load_task(
        make_task(tmp_path, toml='[environment]\ndocker_image = "python:3.12-slim"\n', dockerfile=None),
        env={},
    )
    assert task.environment_dir is None and task.config.environment.docker_image == "python:3.12-slim"
    compose = make_task(tmp_path, "composed", toml="")
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    refused(compose, "compose-based task environments are not supported")


def test_an_unset_host_variable_is_refused_by_name(tmp_path):
    task = make_task(tmp_path, toml='[environment]\nenv = { KEY = "${BELAYER_SURELY_UNSET_VAR}" }\n')
    with pytest.raises(HarborTaskError, match=r"environment.env.KEY needs \$\{BELAYER_SURELY_UNSET_VAR\}"):
        load_task(task, env={})


def test_a_directory_name_that_is_no_task_id_is_refused(tmp_path):
    refused(make_task(tmp_path, "bad name"), "is the task's id", "rename the directory")


def test_a_dataset_is_its_task_directories_in_order(tmp_path):
    for name in ("b-task", "a-task"):
        make_task(tmp_path / "set", name, toml="")
    (tmp_path / "set" / "README.md").write_text("a dataset\n")
    assert is_harbor_path(tmp_path / "set") and is_harbor_path(tmp_path / "set" / "a-task")
    assert [task.id for task in load_harbor(tmp_path / "set")] == ["a-task", "b-task"]
    (tmp_path / "set" / "notes").mkdir()
    refused(tmp_path / "set", "notes has no task.toml")
    assert not is_harbor_path(tmp_path / "empty-file.yaml")


MULTI_TOML = """
[verifier]
timeout_sec = 50.0
env = { SHARED = "1" }

[[steps]]
name = "01-write"
min_reward = 1.0
artifacts = ["/app/out.txt"]
[steps.verifier]
env = { STEP = "one" }

[[steps]]
name = "02-read"
[steps.agent]
timeout_sec = 7.0
"""


def make_multistep(root: Path) -> Path:
    task = make_task(root, "multi", toml=MULTI_TOML, instruction=None, solution=False)
    for name in ("01-write", "02-read"):
        step = task / "steps" / name
        step.mkdir(parents=True)
        (step / "instruction.md").write_text(f"do {name}\n")
    (task / "steps" / "01-write" / "setup.sh").write_text("mkdir -p /app\n")
    (task / "steps" / "01-write" / "tests").mkdir()
    (task / "steps" / "01-write" / "tests" / "test.sh").write_text("exit 0\n")
    return task


def test_steps_read_in_order_with_task_settings_merged_under_their_own(tmp_path):
    task = load_task(make_multistep(tmp_path), env={})
    first, second = task.steps
    assert task.multi_step and [first.name, second.name] == ["01-write", "02-read"]
    assert first.tests_dirs == (task.path / "tests", task.path / "steps/01-write/tests")
    assert second.tests_dirs == (task.path / "tests",)
    assert first.verifier.env == {"SHARED": "1", "STEP": "one"} and first.verifier.timeout_sec == 50.0
    assert second.agent.timeout_sec == 7.0 and second.verifier.env == {"SHARED": "1"}
    assert first.min_reward == 1.0 and second.min_reward is None and first.artifacts == ("/app/out.txt",)
    assert first.setup_script == task.path / "steps/01-write/setup.sh" and second.setup_script is None


def test_a_step_without_its_directory_or_any_verifier_is_refused(tmp_path):
    task = make_multistep(tmp_path)
    (task / "tests" / "test.sh").unlink()
    refused(task, "no tests/test.sh for step '02-read'")
    (task / "task.toml").write_text(MULTI_TOML + '\n[[steps]]\nname = "03-gone"\n')
    (task / "tests" / "test.sh").write_text("exit 0\n")
    refused(task, "steps/03-gone", "needs its directory")
    (task / "task.toml").write_text(MULTI_TOML + '\n[[steps]]\nname = "01-write"\n')
    refused(task, "step names repeat (01-write)")
