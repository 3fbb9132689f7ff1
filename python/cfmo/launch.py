"""python3 -m cfmo.launch -n N script.py [ARGS...]: N local workers.

cfmo-train's --workers launcher (libcfmo's launch_local), for a script:
each rank runs `python3 script.py ARGS...` with RANK, WORLD_SIZE and
CFMO_RENDEZVOUS set, so cfmo.World() connects it. Output is relayed line by
line ("[rank K] " before the stderr of every rank and the stdout of ranks
above 0); a rank that outlives the others, stopped or hung, is ended; UCX's
shared memory goes to a directory of the run's own, removed at the end.
Ctrl-C (or SIGTERM) reaches each rank once, as SIGINT. The exit status is
the root cause's: 0 when every rank succeeded, the first failure that is not
a peer's, else 4 (a rank killed counts as 4), 130 when interrupted.
"""

import argparse
import os
import sys

from . import ConfigError, launch_local


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m cfmo.launch", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--workers", type=int, required=True, help="ranks to start on this host")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds a stopped rank may outlive the others before it is ended (default 10)")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    options = parser.parse_args(argv)
    if not os.path.isfile(options.script):
        print(f"cfmo.launch: '{options.script}': no such file", file=sys.stderr)
        return 2
    try:
        return launch_local(options.workers, [sys.executable, options.script, *options.args], options.grace)
    except ConfigError as e:
        print(f"cfmo.launch: {e}", file=sys.stderr)
        return e.exit_status


if __name__ == "__main__":
    sys.exit(main())
