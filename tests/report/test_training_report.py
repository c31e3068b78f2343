"""`belayer report` on a `belayer train --json` result: one self-contained page with the
reward curve (beside a control run when given) and the time split, read from the JSON
alone. The fixtures are hand-written: a 6-iteration run whose reward rises from 0.31 to
0.83 under three injected faults, and its lr = 0 control, flat around 0.3."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from belayer.report.build import build_report
from belayer.report.data import ReportError, TrainingRun, control_warnings, load_input, load_training

FIXTURES = Path(__file__).parent / "fixtures"
TRAIN, CONTROL = FIXTURES / "train.json", FIXTURES / "control.json"
PNG = b"\x89PNG\r\n\x1a\n"
EMBEDDED = re.compile(r"<img alt='([^']+)' src='data:image/png;base64,")


def build(tmp_path: Path, run: Path = TRAIN, control: Path | None = None, benches: list[Path] = ()) -> str:
    page = asyncio.run(build_report(run, tmp_path / "out", list(benches), None, control))
    assert page == tmp_path / "out" / "report.html"
    return page.read_text()


def rewritten(tmp_path: Path, source: Path, change) -> Path:
    """A copy of a fixture with `change` applied to its parsed document."""
    document = json.loads(source.read_text())
    change(document)
    path = tmp_path / f"changed-{source.name}"
    path.write_text(json.dumps(document))
    return path


def test_a_training_result_is_told_from_run_and_soak_results():
    run = load_input(TRAIN)
    assert isinstance(run, TrainingRun)
    assert run.run_id == "train-7f3a" and run.label == "lr=1e-05" and len(run.iterations) == 6
    assert [f.injected for f in run.faults] == [True, True, True, False]


def test_page_names_the_run_and_embeds_both_figures(tmp_path):
    text = build(tmp_path)
    assert (tmp_path / "out" / "reward.png").read_bytes().startswith(PNG)
    assert (tmp_path / "out" / "time.png").read_bytes().startswith(PNG)
    assert EMBEDDED.findall(text) == ["Reward", "Time per iteration"]
    assert not re.search(r"(src|href)=['\"]https?:", text)  # opens offline
    assert "<title>Belayer training report — train-7f3a</title>" in text
    final = json.loads(TRAIN.read_text())["final_weights_sha256"]
    for expected in (
        final,
        "0.312 (iteration 0) → 0.833 (iteration 5)",
        "examples/workloads/learn.yaml",
        "tiny-warm",
        "1e-05",
        "3 injected of 4 planned, 3 recovered",
        "not injected: the run finished first",
        "trainer restart from checkpoint",
        "can exceed the rollout time",
        "6m 03s",
    ):
        assert expected in text


def test_iteration_table_has_a_row_per_iteration(tmp_path):
    text = build(tmp_path)
    table = text.split("<h2>Iterations</h2>")[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td><td>([^<]+)</td>", table)
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert rows[0][1:] == ("0.312", "0.250", "56s") and rows[-1][1:] == ("0.833", "0.750", "6m 03s")
    sha = json.loads(TRAIN.read_text())["iterations"][5]["weights_sha256"]
    assert f"v7 {sha[:12]}" in table and sha not in table
    assert "member 2 ended failed_infra" in text  # the group dropped in iteration 5, and why
    assert "<th>engine logprob drift</th>" in table and "<td>1.2e-05</td>" in table
    assert "<th>actions per trajectory</th>" in table and "<td>1.25</td>" in table
    assert "1.000 (iteration 0) → 2.500 (iteration 5), +1.500" in text  # the summary's line


def test_the_trainers_numbers_and_each_task_familys_reward_have_a_table(tmp_path):
    def report_metrics(document):
        for n, i in enumerate(document["iterations"]):
            i.update(kl=0.0, clip_fraction=0.05, entropy=2.0 - 0.25 * n, grad_norm=0.5, lr=1e-5 * (1 - n / 6),
                     response_tokens=40.0 + n, rewards_by_family={"learn-sum": 0.25 + 0.1 * n, "trace": 1.0})  # fmt: skip

    text = build(tmp_path, rewritten(tmp_path, TRAIN, report_metrics))
    table = text.split("<h2>Trainer</h2>")[1].split("</table>")[0]
    assert (
        "<th>entropy</th>" in table
        and "<th>reward: learn-sum</th>" in table
        and "<th>reward: trace</th>" in table
    )
    rows = re.findall(r"<tr><td>(\d+)</td>((?:<td>[^<]*</td>)+)</tr>", table)
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert re.findall(r"<td>([^<]*)</td>", rows[-1][1])[3:] == [
        "0.750",
        "0.500",
        "1.67e-06",
        "45.0",
        "0.750",
        "1.000",
    ]
    assert "<h2>Trainer</h2>" not in build(tmp_path / "before")  # a run from before they were reported


def test_control_appears_only_when_given(tmp_path):
    alone = build(tmp_path / "alone")
    assert "control" not in alone.lower()
    compared = build(tmp_path / "compared", control=CONTROL)
    assert "run control-7f3a (completed), lr=0" in compared
    assert "The dashed lines are the control run (lr=0)." in compared
    assert "class='warn'" not in compared  # the same workload, only the learning rate changed
    assert EMBEDDED.findall(compared) == ["Reward", "Time per iteration"]


def test_a_control_from_another_workload_is_a_warning_not_a_failure(tmp_path):
    other = rewritten(
        tmp_path, CONTROL, lambda d: d["settings"].update(workload="examples/workloads/agent.yaml", seed=3)
    )
    text = build(tmp_path, control=other)
    warnings = re.findall(r"<p class='warn'>([^<]*)</p>", text)
    assert len(warnings) == 2
    assert "different workload (examples/workloads/agent.yaml)" in warnings[0]
    assert "seed 0 in the run, 3 in the control" in warnings[1]
    assert (tmp_path / "out" / "reward.png").read_bytes().startswith(PNG)


def test_a_control_started_from_another_directory_is_the_same_workload(tmp_path):
    moved = rewritten(tmp_path, CONTROL, lambda d: d["settings"].update(workload="learn.yaml"))
    assert control_warnings(load_training(TRAIN), load_training(moved)) == []


def test_a_control_from_before_the_algorithm_setting_ran_the_default_one(tmp_path):
    """Runs recorded before `algorithm` existed ran GRPO: against a GRPO run that is no
    difference, against another algorithm it is named."""
    run = rewritten(tmp_path, TRAIN, lambda d: d["settings"].update(algorithm="grpo"))
    assert control_warnings(load_training(run), load_training(CONTROL)) == []
    other = rewritten(tmp_path, TRAIN, lambda d: d["settings"].update(algorithm="rloo"))
    assert control_warnings(load_training(other), load_training(CONTROL)) == [
        "the control differs from the run in more than the learning rate: algorithm rloo in the run, grpo in "
        "the control"
    ]


def test_a_control_with_the_runs_own_learning_rate_is_named():
    assert control_warnings(load_training(TRAIN), load_training(TRAIN)) == [
        "the control has the run's own learning rate (1e-05); a control usually has lr 0"
    ]


def test_a_run_from_before_elapsed_time_and_settings_still_reports(tmp_path):
    def strip(document):
        del document["settings"], document["faults"]
        for iteration in document["iterations"]:
            del iteration["elapsed_s"], iteration["recovery_s"]

    text = build(tmp_path, run=rewritten(tmp_path, TRAIN, strip))
    assert "(no settings recorded)" in text
    assert "wall minute" not in text  # no elapsed-time panel to describe
    assert EMBEDDED.findall(text) == ["Reward", "Time per iteration"]


def test_a_run_without_iterations_reports_without_figures(tmp_path):
    empty = rewritten(
        tmp_path,
        TRAIN,
        lambda d: d.update(iterations=[], status="failed_infra", reason="no rollout node answered"),
    )
    text = build(tmp_path, run=empty)
    assert "The run recorded no iteration" in text and "no rollout node answered" in text
    assert "<td class='bad'>failed_infra</td>" in text
    assert EMBEDDED.findall(text) == []


def test_bench_tables_still_sit_beside_a_training_report(tmp_path):
    bench = tmp_path / "training-bench.json"
    bench.write_text(json.dumps({"goodput_ratio": 1.7, "failure_free_overhead_pct": 3.2}))
    text = build(tmp_path, benches=[bench])
    assert "goodput_ratio" in text and "training-bench.json" in text


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"something": "else"}', r"its keys: something.*\"run_id\", \"status\" and an \"iterations\" list"),
        ("[1, 2]", r"`belayer train --json` result"),
        ("not json", r"is not JSON"),
    ],
)
def test_a_file_of_no_known_kind_says_what_was_expected(tmp_path, content, expected):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=expected):
        load_input(path)


def test_an_iteration_missing_a_field_is_named(tmp_path):
    broken = rewritten(tmp_path, TRAIN, lambda d: d["iterations"][2].pop("rollout_s"))
    with pytest.raises(ReportError, match=r"iterations\[2\]\.rollout_s is missing \(each iteration needs "):
        load_input(broken)
    wrong = rewritten(tmp_path, TRAIN, lambda d: d["iterations"][0].update(mean_reward="high"))
    with pytest.raises(ReportError, match=r"iterations\[0\]\.mean_reward is 'high'"):
        load_input(wrong)


def test_control_must_be_a_training_result(tmp_path):
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({"trajectories": [], "wall_s": 1.0}))
    with pytest.raises(ReportError, match=r"control .*run\.json is not a `belayer train --json` result"):
        build(tmp_path, control=run_json)
    with pytest.raises(ReportError, match=r"--control compares training runs"):
        build(tmp_path, run=run_json, control=CONTROL)


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The real command in its own process (it ends with os._exit), with a state directory
    of its own: no stack is running for it."""
    env = dict(os.environ, BELAYER_STATE_DIR=str(tmp_path / "state"))
    return subprocess.run(
        [sys.executable, "-m", "belayer.cli", "report", *args],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


@pytest.mark.usefixtures("local_processes")
def test_cli_reports_a_training_run_without_temporal(tmp_path):
    out = tmp_path / "out"
    result = run_cli(
        tmp_path, str(TRAIN), "--out", str(out), "--control", str(CONTROL)
    )  # --history is the default
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "report.html")
    assert {p.name for p in out.iterdir()} == {"report.html", "reward.png", "time.png"}


@pytest.mark.usefixtures("local_processes")
def test_cli_names_the_expected_keys_for_an_unknown_file(tmp_path):
    unknown = tmp_path / "notes.json"
    unknown.write_text('{"loss": 0.1}')
    result = run_cli(tmp_path, str(unknown), "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    assert '"run_id", "status" and an "iterations" list' in result.stderr and "Traceback" not in result.stderr
