"""Fixtures for the cfmo module's tests: worlds of real processes started by
the module's own launcher (python3 -m cfmo.launch), over real UCX."""

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


class World:
    def __init__(self, status, stdout, stderr, results):
        self.status = status
        self.stdout = stdout
        self.stderr = stderr
        self.results = results  # rank -> its JSON

    def __repr__(self):
        return f"status {self.status}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


@pytest.fixture
def workdir():
    # Removed at the end, whatever happened (pytest's tmp_path keeps the last runs).
    with tempfile.TemporaryDirectory(prefix="cfmo-pytest-") as d:
        yield d


def shm_entries():
    return set(glob.glob("/dev/shm/cfmo-ucx-*"))


@pytest.fixture
def run_world(workdir):
    """run_world(n, scenario, **config): n ranks of worker.py; their results."""
    shm_before = shm_entries()

    def run(n, scenario, timeout=240, **config):
        config.update(scenario=scenario, out=workdir)
        path = os.path.join(workdir, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        for old in glob.glob(os.path.join(workdir, "rank-*.json")):
            os.remove(old)
        env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning", OMP_NUM_THREADS="1")
        for name in ("RANK", "WORLD_SIZE", "CFMO_RENDEZVOUS", "CFMO_LAUNCHED"):
            env.pop(name, None)
        done = subprocess.run([sys.executable, "-m", "cfmo.launch", "-n", str(n), os.path.join(HERE, "worker.py"),
                               path], capture_output=True, text=True, timeout=timeout, env=env)
        results = {}
        for rank in range(n):
            p = os.path.join(workdir, f"rank-{rank}.json")
            if os.path.exists(p):
                with open(p) as f:
                    results[rank] = json.load(f)
        return World(done.returncode, done.stdout, done.stderr, results)

    yield run
    assert shm_entries() <= shm_before, "UCX shared memory left in /dev/shm"
