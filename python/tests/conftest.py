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


def shm_entries(launcher_pid):
    # The launcher's own directory for UCX's shared memory (other runs on this host have theirs).
    return glob.glob(f"/dev/shm/cfmo-ucx-{launcher_pid}-*")


@pytest.fixture
def run_world(workdir):
    """run_world(n, scenario, **config): n ranks of worker.py; their results."""
    launchers = []

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
        with subprocess.Popen([sys.executable, "-m", "cfmo.launch", "-n", str(n), os.path.join(HERE, "worker.py"),
                               path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as launcher:
            launchers.append(launcher.pid)
            try:
                stdout, stderr = launcher.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                launcher.terminate()  # passed on to the ranks as one SIGINT; the launcher then cleans up
                try:
                    stdout, stderr = launcher.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    launcher.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
                    stdout, stderr = launcher.communicate()
                stderr += f"\n(the test killed the launcher after {timeout} s)"
        results = {}
        for rank in range(n):
            p = os.path.join(workdir, f"rank-{rank}.json")
            if os.path.exists(p):
                with open(p) as f:
                    results[rank] = json.load(f)
        return World(launcher.returncode, stdout, stderr, results)

    yield run
    for pid in launchers:
        assert not shm_entries(pid), "UCX shared memory left in /dev/shm"
