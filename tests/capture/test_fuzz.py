"""Property tests: every reader of a file privfl or a user wrote gives a valid object or a one-line PrivflError.

For any bytes: the stores (manifest, index, head, blobs), a run's config.json/run.json/metrics.jsonl/summary.json,
the partition and the checkpoint, a user's config file (.toml/.yaml/.json), the IDX dataset files, and what the
attack and analysis commands open (AttackerView, RunModels). ``verify_run`` must not raise at all. A hang fails
the example (per-input alarm), as does an invalid object or a multi-line message.

The inputs are hypothesis-driven mutations of a small intact run built directly (no training, no dataset; it
passes ``verify_run``): the same readers and mutations as ``experiments/robustness/fuzz_readers.py``, which runs them at
scale. Deterministic (``derandomize=True``); about 30-60 s on two cores.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.robustness import fuzz_readers as fz

INPUT_TIMEOUT = 10.0  # seconds one input may take (readers answer in milliseconds; a loaded CI machine is slow)


#: examples per reader, sized so that the module runs in about a minute (verify_run reads the whole run)
EXAMPLES = {
    "store.open": 120,
    "store.index": 120,
    "store.load": 150,
    "run.open": 120,
    "run.describe": 60,
    "run.metrics": 120,
    "run.summary": 100,
    "run.partition": 150,
    "run.checkpoint": 150,
    "config.file": 150,
    "verify_run": 50,
    "attacker_view": 100,
    "run_models": 100,
    "idx": 150,
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Any:
    """A writable copy of a small intact run (plus config files and IDX files); each input is put back after use."""
    base = fz.build_base_run(tmp_path_factory.mktemp("fuzz-base") / "run")
    return fz.Workspace(base, tmp_path_factory.mktemp("fuzz-ws") / "ws")


@pytest.fixture(scope="module")
def targets(workspace) -> dict[str, Any]:
    return {t.name: t for t in fz.build_targets(workspace)}


def test_every_reader_is_covered(targets) -> None:
    assert set(EXAMPLES) == set(targets)


@pytest.mark.parametrize("reader", sorted(EXAMPLES))
def test_reader_accepts_the_intact_run(workspace, targets, reader: str) -> None:
    """The base is valid: every reader opens each of its files unchanged (so a mutation that fails is the mutation's doing)."""
    target = targets[reader]
    for rel, _ in target.files:
        out = fz.run_one(target, workspace, rel, workspace.read(rel), 600)
        assert out.kind == "ok", f"{reader} refuses the intact {rel}: {out.detail}"


def test_harness_flags_tracebacks_hangs_and_multiline_errors(workspace) -> None:
    """The property below can fail: another exception, a hang, a multi-line PrivflError are each caught and named."""
    from privfl.errors import CaptureError

    def raises(ws: Any, rel: str) -> None:
        raise KeyError("x")

    def hangs(ws: Any, rel: str) -> None:
        time.sleep(5)

    def two_lines(ws: Any, rel: str) -> None:
        raise CaptureError("one\ntwo")

    rel = "run/config.json"
    data = workspace.read(rel)
    assert fz.run_one(fz.Target("t", [], raises), workspace, rel, data, 5).kind == "traceback"
    assert fz.run_one(fz.Target("t", [], hangs), workspace, rel, data, 0.2).kind == "hang"
    assert fz.run_one(fz.Target("t", [], two_lines), workspace, rel, data, 5).kind == "traceback"
    assert workspace.read(rel) == data  # and the file is put back


# ------------------------------------------------------------------------------------------------ inputs

json_values = st.one_of(
    st.sampled_from(fz.VALUES),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=8,
    ),
)


def mutations(fmt: str) -> st.SearchStrategy[list[Any]]:
    """1-3 edits, half of them format-aware (JSON values, safetensors header, IDX fields); ``a`` and ``b`` pick
    where and which variant, small numbers as often as large ones."""
    special = fz.FORMAT_OPS[fmt]
    ops = st.one_of(st.sampled_from(special), st.sampled_from(fz.BYTE_OPS)) if special else st.sampled_from(fz.BYTE_OPS)
    number = st.integers(0, 255) | st.integers(0, 2**32)
    one = st.builds(fz.Mutation, op=ops, a=number, b=number, blob=st.binary(max_size=64), value=json_values)
    return st.lists(one, min_size=1, max_size=3)


def draw_input(data: st.DataObject, workspace: Any, files: list[tuple[str, str]]) -> tuple[str, bytes]:
    """One of the reader's files, mutated (format-aware or byte-level), or replaced by random bytes."""
    rel, fmt = data.draw(st.sampled_from(files), label="file")
    if data.draw(st.integers(0, 15), label="random bytes?") == 0:
        return rel, data.draw(st.binary(max_size=4096), label="bytes")
    edits = data.draw(mutations(fmt), label="mutations")
    return rel, fz.apply_mutations(workspace.read(rel), edits, fmt, workspace.pool)


# ------------------------------------------------------------------------------------------------ property


def _check(workspace: Any, targets: dict[str, Any], reader: str, data: st.DataObject) -> None:
    target = targets[reader]
    rel, content = draw_input(data, workspace, target.files)
    out = fz.run_one(target, workspace, rel, content, INPUT_TIMEOUT)
    assert out.kind in ("ok", "error"), f"{reader} on a mutated {rel} ({len(content)} bytes): {out.kind}: {out.detail}"


def _property(reader: str) -> Any:
    @pytest.mark.timeout(300)  # a backstop; a hang fails one input after INPUT_TIMEOUT
    @settings(
        max_examples=EXAMPLES[reader],
        deadline=None,  # per-input time is bounded by INPUT_TIMEOUT (an alarm), not by hypothesis' timing
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def test(workspace: Any, targets: dict[str, Any], data: st.DataObject) -> None:
        _check(workspace, targets, reader, data)

    test.__doc__ = f"{reader}: any mutation of its files gives a valid object or a one-line PrivflError" + (
        " (verify_run: a report, never an exception)" if reader == "verify_run" else ""
    )
    return test


test_store_open = _property("store.open")
test_store_index_scan_verify_records = _property("store.index")
test_store_load_safetensors_blob = _property("store.load")
test_run_open = _property("run.open")
test_run_describe = _property("run.describe")
test_run_metrics = _property("run.metrics")
test_run_summary = _property("run.summary")
test_run_partition = _property("run.partition")
test_run_checkpoint = _property("run.checkpoint")
test_config_file = _property("config.file")
test_verify_run = _property("verify_run")
test_attacker_view = _property("attacker_view")
test_run_models = _property("run_models")
test_idx = _property("idx")
