"""scripts/launch_compare.py: its records of this tree's launches (well-formed, without addresses, the same in two
processes, the replayed second call launching what the first did) and its comparison (a changed launch differs, the
intended new constexprs at their neutral values do not)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from launch_compare import compare

ROOT = Path(__file__).resolve().parents[2]

# a dense warp-specialised GQA call, a varlen one-launch call with empty sequences and every score feature, v's own
# head dim, a chunked backward
CALLS = ("d64-causal-ws-gqa", "d64-one_launch-varlen-everything", "dv-d64-v128-default", "d128-ws-workspace-cap")


def _records() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FLASH_ATTN_CK_BACKEND", None)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_compare.py"), "--dump", *CALLS], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def records():
    return _records()


def _leaves(value):
    if isinstance(value, dict) and ("tensor" in value or "address" in value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)


def test_every_call_is_recorded_twice_with_well_formed_launches(records):
    assert sorted(records) == sorted(CALLS)
    for name, runs in records.items():
        assert len(runs) == 2 and all("error" not in run for run in runs), (name, runs)
        for run in runs:
            assert run["launches"], name
            for launch in run["launches"]:
                assert launch["kernel"].endswith("_kernel")
                assert len(launch["grid"]) == 3 and all(isinstance(n, int) and n >= 1 for n in launch["grid"])
                assert launch["options"]["num_warps"] in (1, 2, 4, 8, 16)
                assert launch["through"] in ("triton", "launcher", "replay")
                assert all(isinstance(path, str) for path, _ in launch["runtime"])
                assert isinstance(launch["constexprs"], dict) and launch["constexprs"]
                for tensor in _leaves(launch["runtime"]):
                    buffer = tensor.get("tensor", tensor.get("address"))
                    assert buffer in run["buffers"], (name, buffer)
                    assert tensor["offset"] >= 0


def test_the_call_s_own_tensors_are_named_by_role(records):
    for name, runs in records.items():
        buffers = runs[0]["buffers"]
        assert {"q", "k", "v", "out", "dout", "dq", "dk", "dv"} <= set(buffers), (name, sorted(buffers))
        others = sorted(b for b in buffers if b.startswith("buf"))
        assert others == [f"buf{i}" for i in range(len(others))], others     # numbered by first use, no gaps


def test_the_second_call_replays_what_the_first_launched(records):
    """Same shapes, other values: the second call's launches are the first's, all through the compiled kernels'
    launchers (the launch memo and the replay), none through Triton's own run; every call but the chunked backward
    (whose chunks are torch views and copies: launched directly) is replayed whole, the Gluon kernels' included."""
    for name, (first, second) in records.items():
        through = {launch["through"] for launch in second["launches"]}
        assert through == ({"replay", "launcher"} if "workspace-cap" in name else {"replay"}), (name, through)
        strip = [{**launch, "through": None} for launch in first["launches"]]
        assert strip == [{**launch, "through": None} for launch in second["launches"]], name
        assert first["buffers"] == second["buffers"], name


def test_records_are_the_same_in_another_process(records):
    """No address, id or order of a process's own leaks into a record."""
    assert _records() == records


def test_a_changed_launch_differs_and_the_neutral_value_head_dim_fields_do_not(records):
    run = records["d64-one_launch-varlen-everything"][0]
    old = copy.deepcopy(run)
    for launch in old["launches"]:
        launch["constexprs"].pop("HEAD_DIM_V", None)
        launch["constexprs"].pop("BLOCK_DV", None)
    found, intended = compare(old, run)
    one_launch = sum("HEAD_DIM_V" in launch["constexprs"] for launch in run["launches"])
    assert found == [] and len(intended) >= one_launch >= 1

    changed = copy.deepcopy(run)
    changed["launches"][-1]["grid"][0] += 1
    found, _ = compare(run, changed)
    assert len(found) == 1 and "grid[0]" in found[0]

    widened = copy.deepcopy(run)
    launch = next(x for x in widened["launches"] if "HEAD_DIM_V" in x["constexprs"])
    launch["constexprs"]["HEAD_DIM_V"] = 96          # a value head dim of its own: a kernel variant, not neutral
    found, _ = compare(old, widened)
    assert any("HEAD_DIM_V" in line for line in found), found
