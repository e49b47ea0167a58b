"""A stand-in for srun inside a SLURM allocation, for the supervisor's tests.

    python tests/fake_srun.py [--kill-on-bad-exit=1] [--exclude=a,b --nodes=N --ntasks=N] CMD...

The allocation is FAKE_SRUN_NODES (comma-separated); the step runs on its first --nodes
nodes that are not excluded. A step that includes the node FAKE_SRUN_BROKEN fails at once as
srun reports it (`srun: error: <node>: task <i>: Exited with exit code 1`, then exit 1);
otherwise a one-node step runs CMD as task 0 with SLURM's variables. Each call's arguments
are appended to FAKE_SRUN_LOG as a JSON line.
"""

import json
import os
import sys


def main() -> int:
    args = sys.argv[1:]
    options = {}
    while args and args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        options[key] = value
    with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
        log.write(json.dumps(options) + "\n")
    excluded = set(filter(None, options.get("exclude", "").split(",")))
    nodes = [n for n in os.environ["FAKE_SRUN_NODES"].split(",") if n not in excluded]
    nodes = nodes[:int(options.get("nodes", len(nodes)))]
    broken = os.environ.get("FAKE_SRUN_BROKEN")
    if broken in nodes:
        print(f"srun: error: {broken}: task {nodes.index(broken)}: Exited with exit code 1",
              file=sys.stderr, flush=True)
        return 1
    if len(nodes) != 1:
        print("fake srun runs one-node steps only", file=sys.stderr)
        return 1
    os.environ.update(SLURM_NTASKS="1", SLURM_PROCID="0")
    os.execvp(args[0], args)


if __name__ == "__main__":
    sys.exit(main())
