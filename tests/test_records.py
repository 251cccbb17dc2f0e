"""The run directory's JSON-lines records under a kill (trainer/records.py): a torn last line — what a process killed
in the middle of an append leaves — is read as absent, cut off before the next append, and dropped when the records
are cut back; a damaged line before the last is refused naming the file and the line."""

import json
import os
import subprocess
import sys
import time

import pytest
from mlflow.entities import Metric

from tasks.metrics_sink import append_pending, pending_count, read_spool
from trainer.records import RecordError, append_rows, keep_rows, read_rows


def test_a_torn_last_line_is_read_as_absent(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert read_rows(path) == [{"step": 1}, {"step": 2}]


def test_an_append_after_a_torn_line_cuts_it_off_first(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "completion": "a long one')
    append_rows(path, [{"step": 2, "completion": "whole"}])
    assert path.read_text() == '{"step": 1}\n{"step": 2, "completion": "whole"}\n'
    only_torn = tmp_path / "prompts.jsonl"
    only_torn.write_text('{"step": 1, "prompt_ind')
    append_rows(only_torn, [{"step": 1}])
    assert read_rows(only_torn) == [{"step": 1}]


def test_a_torn_line_longer_than_the_read_back_window_is_cut_off_too(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "completion": "' + "x" * 200_000)
    append_rows(path, [{"step": 2}])
    assert read_rows(path) == [{"step": 1}, {"step": 2}]


def test_cutting_the_records_back_drops_the_torn_line_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6')
    keep_rows(path, lambda row: row["step"] <= 3)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_damaged_line_before_the_last_is_refused_naming_the_file_and_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(RecordError, match=r"metrics\.jsonl: line 2 is not a JSON row"):
        read_rows(path)


def test_a_spool_with_a_torn_batch_keeps_its_whole_batches_and_takes_new_ones(tmp_path):
    spool = tmp_path / "mlflow-pending.jsonl"
    append_pending(spool, "r", [Metric("reward", 0.5, 1, 1)])
    with open(spool, "a") as f:
        f.write('{"run_id": "r", "metrics": [["reward", 0.6, 2, ')  # killed while spooling step 2
    assert pending_count(spool) == 1
    append_pending(spool, "r", [Metric("reward", 0.7, 3, 3)])
    assert [(m.step, m.value) for m in read_spool(spool)] == [(1, 0.5), (3, 0.7)]


def test_a_process_killed_in_a_long_append_leaves_rows_the_next_append_can_follow(tmp_path):
    """A real SIGKILL in the middle of a stream of appends: whatever it cut, the file reads back as whole rows,
    and a row appended after it is read back whole."""
    path = tmp_path / "samples.jsonl"
    child = (
        "import sys; from trainer.records import append_rows\n"
        "print('started', flush=True)\n"
        "while True: append_rows(sys.argv[1], [{'step': 1, 'completion': 'x' * 300_000}] * 8)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    while (not path.exists() or path.stat().st_size < 20_000_000) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    rows = read_rows(path)
    assert rows and all(row == {"step": 1, "completion": "x" * 300_000} for row in rows)
    append_rows(path, [{"step": 2}])
    assert read_rows(path)[-1] == {"step": 2} and len(read_rows(path)) == len(rows) + 1
    os.remove(path)
