"""Worlds of 2 and 4 real processes, started by python3 -m cfmo.launch."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cfmo

pytest.importorskip("torch")


def ok(world, n):
    assert world.status == 0, world
    assert sorted(world.results) == list(range(n)), world
    return world.results


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", cfmo.MODES)
def test_every_mode_converges(run_world, mode, n):
    results = ok(run_world(n, "converge", mode=mode, steps=240, wrapper=(n == 4)), n)
    rank0 = results[0]
    assert rank0["global"]
    loss0, _ = rank0["before"]
    loss, accuracy = rank0["after"]
    assert loss < 0.5 * loss0 and accuracy > 0.8, rank0
    if mode in ("localsgd", "cfmo", "asgd"):
        assert all(r["stats"]["rounds"] > 0 for r in results.values())
    if mode == "cfmo":
        assert sum(r["stats"]["contributions_applied"] for r in results.values()) > 0


@pytest.mark.parametrize("mode", ["cfmo", "localsgd"])
def test_a_nonzero_delta_reaches_the_owners(run_world, mode):
    # Only rank 1 trains; rank 0's global parameters move on both shards all the same.
    results = ok(run_world(2, "delta_reaches_owners", mode=mode), 2)
    assert results[0]["global"]
    assert results[0]["min"] > 0, results[0]
    assert results[0]["stats"]["contributions_applied"] > 0 or mode == "localsgd"
    assert results[1]["stats"]["contributions_applied"] > 0 or mode == "localsgd"


def test_no_worker_waits_for_a_held_one_in_cfmo(run_world):
    # Rank 1 is held until rank 0 has taken every step: with a blocking
    # reconciliation rank 0 would never get there (and the test would time out).
    results = ok(run_world(2, "no_wait", mode="cfmo"), 2)
    assert "error" not in results[1], results[1]
    assert results[0]["stats"]["step"] == 60
    assert results[0]["stats"]["rounds"] > 1
    assert results[0]["stats"]["wait_s"] == 0


def test_the_discount_is_beta_to_the_staleness_not_a_running_product(run_world):
    # 100 steps: a shard's exponent is at most its owner's version / 2 <= 100, so 0.5**e stays a normal float.
    results = ok(run_world(2, "discount", steps=100), 2)
    for r in results.values():
        # Each shard's first moment is one power of beta (every element of it the same) ...
        assert all(len(e) == 1 for e in r["exponents"]), r
        # ... whose exponents add up to the staleness of the contributions behind its rebases.
        # (A running product would have shrunk it at every rebase, stale or not.)
        assert sum(e[0] for e in r["exponents"]) == pytest.approx(r["staleness_sum"]), r


@pytest.mark.parametrize("mode", ["localsgd", "sync"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(run_world, mode):
    whole = ok(run_world(2, "resume", mode=mode, steps=40, save_at=20), 2)
    resumed = ok(run_world(2, "resume", mode=mode, steps=40, resume=True), 2)
    for rank in range(2):
        assert whole[rank]["params"] == resumed[rank]["params"]


@pytest.mark.parametrize("mode", ["cfmo", "asgd"])
def test_rank_0_gathers_the_global_state(run_world, mode):
    results = ok(run_world(2, "async_state", mode=mode), 2)
    assert results[0]["has_params"] and results[0]["ranks"] == 2
    assert not results[1]["has_params"]  # only rank 0 gathers it
    for r in results.values():
        assert r["loaded_first"] == r["saved_first"]


def test_a_killed_rank_fails_sync_with_peer_lost(run_world):
    world = run_world(2, "killed", mode="sync", steps=200, peer_timeout=3)
    assert world.status == 4, world
    assert "rank 1 was killed by signal 9" in world.stderr
    r = world.results[0]
    assert r["raised"] == "PeerLost" and r["exit_status"] == 4
    assert "rank 1" in r["message"], r


def test_a_killed_rank_is_reported_in_cfmo_and_the_others_finish(run_world):
    world = run_world(2, "killed", mode="cfmo", steps=100, peer_timeout=3)
    assert world.status == 4, world  # the launcher counts the killed rank
    r = world.results[0]
    assert r["raised"] is None and r["lost"] == [1], r
    assert any("rank 1 lost" in w for w in r["warnings"]), r


@pytest.mark.parametrize("shapes,message", [
    ([[10], [12]], "params differ between workers: rank 0 has 1 tensors (10 floats), rank 1 has 1 tensors (12 floats)"),
    ([[4, 3], [3, 4]], "params differ between workers: rank 1's tensor names or shapes are not rank 0's"),
])
def test_mismatched_parameters_raise_on_every_rank(run_world, shapes, message):
    results = ok(run_world(2, "mismatch", shapes=shapes), 2)
    for r in results.values():
        assert r["raised"] == message


def test_deltas_are_cfd_files_cfmo_diverge_reads(run_world, workdir):
    run = os.path.join(workdir, "run")
    results = ok(run_world(2, "deltas", mode="cfmo", run=run), 2)
    for rank, r in results.items():
        files = sorted(os.listdir(os.path.join(run, "deltas", f"rank-{rank}")))
        assert len(files) == r["written"] > 0, (files, r)
    diverge = os.environ.get("CFMO_DIVERGE")
    if not diverge:
        pytest.skip("CFMO_DIVERGE not set (meson test sets it)")
    check = subprocess.run([diverge, "report", run, "--format", "json"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert '"rank": 1' in check.stdout.replace('"rank":1', '"rank": 1')


def test_the_example_trains_under_the_launcher(workdir):
    # examples/torch_mlp.py as docs/PYTHON.md runs it, on synthetic data: the
    # shared sample budget (mode cfmo) ends both workers; rank 0 prints the JSON.
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch_mlp.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "cfmo.launch", "-n", "2", example, "--data", "synthetic:2000:500",
                          "--samples", "4000", "--hidden", "32", "--json", "--out", os.path.join(workdir, "run")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["workers"] == 2 and result["samples"] >= 4000
    assert result["bytes_sent"] > 0 and 0 < result["efficiency"] <= 1.01
    assert os.listdir(os.path.join(workdir, "run", "deltas"))


@pytest.mark.parametrize("mode", ["sync", "cfmo"])
def test_ctrl_c_reaches_every_rank_once_and_the_run_exits_130(workdir, mode):
    import glob
    import signal
    import time

    config = os.path.join(workdir, "config.json")
    with open(config, "w") as f:
        json.dump({"scenario": "forever", "out": workdir, "mode": mode}, f)
    worker = os.path.join(os.path.dirname(__file__), "worker.py")
    with subprocess.Popen([sys.executable, "-m", "cfmo.launch", "-n", "2", worker, config], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as launcher:
        deadline = time.monotonic() + 120
        while len(glob.glob(os.path.join(workdir, "started-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr
    assert not glob.glob(f"/dev/shm/cfmo-ucx-{launcher.pid}-*")
